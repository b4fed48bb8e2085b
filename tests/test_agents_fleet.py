"""Scripted agent loops of real client libraries against ``make run``'s fleet (issue 33, "Done
when" 2; docs/api.md): the ``anthropic`` client's tool-use round trip on ``/v1/messages``, the
``openai`` client's embeddings and stored responses, instructor in its TOOLS and JSON modes,
and the OpenAI Agents SDK running two tools over ``/v1/responses`` (plain and streamed).

The fleet is the one ``make run`` starts (``python -m sfnode fleet``: ``twistd sfnode`` on the
bundled SmolLM2 and ``twistd sfhead``, real processes), with its ``--embedding-model`` node
serving all-MiniLM-L6-v2; it is started once for the module (:class:`RunningFleet`) and stopped
after the last test (or when the test process exits, if only some of them ran).  Each loop is a
handful of short greedy requests.  Calls are forced with ``tool_choice`` and JSON with a schema,
so what is asserted is that every structured answer parses and validates, never what a 135M
model knows.  Locally ``SFNODE_SKIP_SLOW=1`` skips the module.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import jsonschema
from twisted.trial.unittest import SynchronousTestCase

from tests.bundled import BUNDLED_MODEL_SKIP
from tests.clients import anthropic_client, openai_client
from tests.embedders import MINILM_SKIP, minilm_folder
from tests.processes import SharedProcess, stop_after_the_class

MODEL = "SmolLM2-135M-Instruct"
EMBEDDER = "all-MiniLM-L6-v2"
READY_S = 600.0
"""A first start converts the bundled GGUF (about half a minute); later starts take seconds."""
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RunningFleet:
    """``python -m sfnode fleet`` with an embedding node, on free loopback ports, in a session
    of its own (stopped as Ctrl-C stops it: SIGINT to its group)."""

    def __init__(self) -> None:
        self.process = SharedProcess("the fleet", stop_signal=signal.SIGINT)
        self.base = ""

    def start(self) -> str:
        """The fleet's base URL, once it says it is up (every node live)."""
        if self.process.child is not None:
            return self.base
        ports = [_free_port() for _ in range(4)]
        script = (
            "import runpy, sys; sys.argv[0:1] = ['sfnode', 'fleet']; "
            "runpy.run_module('sfnode', run_name='__main__')"
        )
        args = ["--http-port", str(ports[0]), "--node-port", str(ports[1]), "--fleet-port",
                str(ports[2]), "--embedding-port", str(ports[3]),
                "--embedding-model", str(minilm_folder())]  # fmt: skip
        folder = Path(os.environ.get("TMPDIR", "/tmp"))
        self.process.start([sys.executable, "-c", script, *args], folder)
        self.process.wait_for(rb"The fleet is up on", READY_S)
        self.base = f"http://127.0.0.1:{ports[0]}"
        return self.base

    def stop(self) -> None:
        """Ctrl-C the fleet and wait for it (it stops its children itself)."""
        self.process.stop()


FLEET = RunningFleet()


class FleetAgentsTests(SynchronousTestCase):
    skip = BUNDLED_MODEL_SKIP or MINILM_SKIP

    def setUp(self) -> None:
        self.base = FLEET.start()
        stop_after_the_class(self, FLEET.stop)

    def openai(self) -> Any:
        return openai_client(self, self.base + "/v1", timeout=120)

    def test_anthropic_tool_use_round_trip(self) -> None:
        """The ``anthropic`` client forces ``get_weather``: the answer stops with
        ``tool_use``, one ``tool_use`` block whose ``input`` validates; its ``tool_result``
        sent back is answered as a message whose prompt holds the whole exchange (more input
        tokens); streamed, the same forced call arrives whole."""
        client = anthropic_client(self, self.base, api_key="unused", timeout=120)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "What is the weather in Paris?"}
        ]
        forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
        first = client.messages.create(
            model=MODEL, max_tokens=64, messages=messages, tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=forced, extra_body={"temperature": 0},  # type: ignore[arg-type]
        )  # fmt: skip
        self.assertEqual(first.stop_reason, "tool_use")
        (use,) = [block for block in first.content if block.type == "tool_use"]
        self.assertEqual(use.name, "get_weather")
        jsonschema.validate(use.input, WEATHER["input_schema"])
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
        ]  # fmt: skip
        second = client.messages.create(
            model=MODEL, max_tokens=16, messages=messages, tools=[WEATHER],  # type: ignore[list-item]
            extra_body={"temperature": 0},
        )  # fmt: skip
        self.assertEqual(second.type, "message")
        self.assertIn(second.stop_reason, ("end_turn", "max_tokens", "tool_use"))
        self.assertGreater(second.usage.input_tokens, first.usage.input_tokens)
        with client.messages.stream(
            model=MODEL, max_tokens=64, messages=messages[:1], tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=forced, extra_body={"temperature": 0},  # type: ignore[arg-type]
        ) as stream:  # fmt: skip
            streamed = stream.get_final_message()
        self.assertEqual(streamed.stop_reason, "tool_use")
        self.assertEqual(
            [b.input for b in streamed.content if b.type == "tool_use"], [use.input]
        )

    def test_openai_embeddings_and_stored_responses(self) -> None:
        """The ``openai`` client embeds two texts (its default base64 encoding decoded: 384
        unit-length floats each) and runs a stored Responses conversation: a second turn
        continues the first by ``previous_response_id``, each is read back with
        ``responses.retrieve``, and a deleted one is gone (404)."""
        import openai

        client = self.openai()
        embedded = client.embeddings.create(model=EMBEDDER, input=["a cat sat", "a dog ran"])
        self.assertEqual([len(d.embedding) for d in embedded.data], [384, 384])
        for datum in embedded.data:
            self.assertAlmostEqual(math.fsum(x * x for x in datum.embedding), 1.0, places=4)
        first = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8,
                                        temperature=0)  # fmt: skip
        second = client.responses.create(
            model=MODEL, input="Again.", previous_response_id=first.id, max_output_tokens=8,
            temperature=0,
        )  # fmt: skip
        self.assertTrue(first.output_text)
        self.assertEqual(second.previous_response_id, first.id)
        self.assertGreater(second.usage.input_tokens, first.usage.input_tokens)
        self.assertEqual(client.responses.retrieve(second.id).output_text, second.output_text)
        client.responses.delete(first.id)
        with self.assertRaises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        self.assertEqual(client.responses.retrieve(second.id).id, second.id)

    def test_instructor_tools_and_json_modes(self) -> None:
        """instructor extracts a pydantic model in TOOLS mode (a forced call), in JSON mode
        (``json_object``; the prompt shows the object) and in JSON_SCHEMA mode: each answer
        parses and validates as the model, with ``max_retries=0`` (no second chance)."""
        import instructor
        from pydantic import BaseModel

        class City(BaseModel):
            name: str
            country: str

        client = self.openai()
        asks = {
            instructor.Mode.TOOLS: "Paris is the capital of France. Extract the city.",
            instructor.Mode.JSON: 'Reply with the JSON object {"name": "Paris", '
            '"country": "France"}.',
            instructor.Mode.JSON_SCHEMA: "Paris is the capital of France. Extract the city.",
        }
        for mode, ask in asks.items():
            patched = instructor.from_openai(client, mode=mode)
            city = patched.chat.completions.create(
                model=MODEL, response_model=City, max_tokens=64, temperature=0, max_retries=0,
                messages=[{"role": "user", "content": ask}],
            )  # fmt: skip
            self.assertIsInstance(city, City, mode)
            self.assertTrue(city.name, mode)

    def test_agents_sdk_two_tool_run(self) -> None:
        """The OpenAI Agents SDK runs two tools in turn over ``/v1/responses``: each turn
        offers one tool (the first until it ran, then the second) with ``tool_choice``
        required, so each call is forced; the run stops at the second tool's output, each
        tool got a city, and the second turn continued the first on the server
        (``previous_response_id``, its input the first call's output). Streamed, the same
        run reads each turn's events: the call item added, argument deltas, done, and
        ``response.completed``."""
        import asyncio

        from agents import (
            Agent,
            ModelSettings,
            OpenAIResponsesModel,
            Runner,
            StopAtTools,
            function_tool,
            set_tracing_disabled,
        )  # fmt: skip
        from openai import AsyncOpenAI

        set_tracing_disabled(True)
        calls: list[tuple[str, str]] = []

        @function_tool(is_enabled=lambda ctx, agent: not calls)
        def get_weather(city: str) -> str:
            """The weather in a city."""
            calls.append(("get_weather", city))
            return "Sunny, 21 C"

        @function_tool(is_enabled=lambda ctx, agent: bool(calls))
        def get_time(city: str) -> str:
            """The local time in a city."""
            calls.append(("get_time", city))
            return "14:05"

        async def runs() -> tuple[Any, Any, list[str]]:
            client = AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)
            agent: Agent[None] = Agent(
                name="helper", instructions="Answer with the tools.",
                tools=[get_weather, get_time],
                model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                model_settings=ModelSettings(tool_choice="required", temperature=0,
                                             max_tokens=48, parallel_tool_calls=False),
                reset_tool_choice=False,
                tool_use_behavior=StopAtTools(stop_at_tool_names=["get_time"]),
            )  # fmt: skip
            ask = "What is the weather and the time in Paris?"
            plain = await Runner.run(agent, ask, max_turns=3, auto_previous_response_id=True)
            calls.clear()
            streamed = Runner.run_streamed(agent, ask, max_turns=3,
                                           auto_previous_response_id=True)  # fmt: skip
            kinds = [e.data.type async for e in streamed.stream_events()
                     if e.type == "raw_response_event"]  # fmt: skip
            await client.close()
            return plain, streamed, kinds

        plain, streamed, kinds = asyncio.run(runs())
        for run in (plain, streamed):
            self.assertEqual(run.final_output, "14:05")
            self.assertEqual(len(run.raw_responses), 2)
        self.assertEqual([name for name, _ in calls], ["get_weather", "get_time"])
        self.assertTrue(all(isinstance(city, str) and city for _, city in calls))
        client = self.openai()
        first, second = (r.response_id for r in plain.raw_responses)
        later = client.responses.retrieve(second)
        self.assertEqual(later.previous_response_id, first)
        self.assertEqual([item.type for item in later.output], ["function_call"])
        self.assertEqual(json.loads(later.output[0].arguments).keys(), {"city"})
        turn = ["response.created", "response.in_progress", "response.output_item.added",
                "response.function_call_arguments.done", "response.output_item.done",
                "response.completed"]  # fmt: skip
        self.assertEqual(
            [k for k in kinds if k != "response.function_call_arguments.delta"], turn * 2
        )
        self.assertIn("response.function_call_arguments.delta", kinds)
