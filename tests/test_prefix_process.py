"""Prefix reuse end to end: real ``twistd sfnode`` processes on the tiny model, a real head.

Nodes are ``twistd --pidfile= -n sfnode`` child processes serving the tiny random Llama of
tests/tinymodel.py with ``--metrics``; the head is the real ``twistd sfhead`` service tree
(``sfnode.head.tap.makeService``) in the test's reactor, on loopback TCP.

- A conversation continues where it stopped: the second turn of a chat (the same messages, the
  assistant's answer and a new user message, rendered by the head's chat template) reuses the
  KV blocks of the first turn on the node (its ``/metrics``), and the answers, greedy and
  seeded, are those of a node started with ``--no-prefix-cache``.
- Requests that share a system prompt land on the node that holds it (docs/protocol.md section
  8.5), and that node really reuses it (its ``/metrics``).

No sleeps: every wait is on a line a process logs, or on a Deferred.
"""

from __future__ import annotations

import json
from io import BytesIO
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.application.service import MultiService
from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import Fleet
from sfnode.head.tap import Options, makeService
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS
from tests.processes import LOOPBACK, Child, spawn_twistd
from tests.tinymodel import save_tiny_model

MODEL = "tiny-llama"
SYSTEM = "You are a node agent. " + " ".join(
    [
        "the quick brown fox jumps over the lazy dog.",
        "a node agent serves language models to a fleet head.",
        "tokens stream back in order and each exactly once.",
        "lanes decode together and the kv cache is counted in blocks.",
    ]
    * 3
)


class TinyNode:
    """A ``twistd sfnode`` process on the tiny model: its Link F and metrics ports."""

    def __init__(self, child: Child, port: int, metrics_port: int) -> None:
        self.child = child
        self.port = port
        self.metrics_port = metrics_port

    @property
    def endpoint(self) -> str:
        return f"tcp:127.0.0.1:{self.port}"


class PrefixProcessTestCase(TestCase):
    timeout = 240

    def setUp(self) -> None:
        self.folder = save_tiny_model(Path(self.mktemp()).resolve() / MODEL, window=512)

    async def start_node(self, identity: str, *args: str) -> TinyNode:
        child = spawn_twistd(
            self,
            Child(identity),
            ["sfnode", "--listen", LOOPBACK, "--metrics", LOOPBACK, "--identity", identity,
             "--model", str(self.folder), "--device", "cpu", "--threads", "1",
             "--max-lanes", "4", *args],
        )  # fmt: skip
        (listening,) = await child.wait_for(rb"sfnode listening on 127\.0\.0\.1:(\d+)\n")
        (metrics,) = await child.wait_for(rb"sfnode metrics on 127\.0\.0\.1:(\d+)\n")
        return TinyNode(child, int(listening.group(1)), int(metrics.group(1)))

    async def start_head(self, nodes: list[TinyNode]) -> tuple[MultiService, Fleet, str]:
        """The sfhead service tree on the tiny model's tokenizer, with ``nodes`` added."""
        options = Options()
        options.parseOptions(
            ["--model", str(self.folder), "--model-name", MODEL, "--http", LOOPBACK,
             "--fleet-listen", LOOPBACK],
        )  # fmt: skip
        head = makeService(options, reactor)
        head.startService()  # type: ignore[no-untyped-call]
        self.addCleanup(head.stopService)  # type: ignore[no-untyped-call]
        port = await head.getServiceNamed("http").bound  # type: ignore[no-untyped-call]
        fleet: Fleet = head.getServiceNamed("fleet").fleet  # type: ignore[no-untyped-call]
        for node in nodes:
            await fleet.add_node(node.endpoint)
        self.assertEqual(len(fleet.live_nodes()), len(nodes))
        return head, fleet, f"http://127.0.0.1:{port.getHost().port}"

    async def metrics(self, node: TinyNode) -> dict[str, float]:
        """The node's ``/metrics`` samples by name."""
        url = f"http://127.0.0.1:{node.metrics_port}/metrics"
        response = await Agent(reactor).request(b"GET", url.encode())
        text = (await readBody(response)).decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    async def chat(self, base: str, messages: list[dict[str, str]], **fields: Any) -> Any:
        body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
        body.update(fields)
        response = await Agent(reactor).request(
            b"POST",
            (base + "/v1/chat/completions").encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        answer = json.loads(await readBody(response))
        self.assertEqual(response.code, 200, answer)
        return answer


class ConversationTests(PrefixProcessTestCase):
    async def converse(self, base: str) -> tuple[list[Any], list[int]]:
        """Two turns of one chat, and a seeded variant of the second; the answers and, per
        request, the prompt tokens the head counted."""
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
        answer = await self.chat(base, first)
        second = [
            *first,
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and the fox?"},
        ]
        greedy = await self.chat(base, second)
        seeded = await self.chat(base, second, temperature=0.9, seed=1234)
        answers = [answer, greedy, seeded]
        return answers, [a["usage"]["prompt_tokens"] for a in answers]

    async def test_the_next_turn_reuses_the_first_and_answers_alike(self) -> None:
        """The second turn reuses at least every full block of the first turn's prompt but the
        one holding its last token (the node computes only the rest); the answers with reuse,
        greedy and seeded, are those of a node without a prefix cache."""
        cached, uncached = await defer.gatherResults(
            [
                defer.Deferred.fromCoroutine(self.start_node("cached")),
                defer.Deferred.fromCoroutine(self.start_node("uncached", "--no-prefix-cache")),
            ]
        )
        _, _, warm_base = await self.start_head([cached])
        _, _, cold_base = await self.start_head([uncached])

        before = await self.metrics(cached)
        first = await self.chat(warm_base, [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": "hello"}])  # fmt: skip
        after_first = await self.metrics(cached)
        self.assertEqual(
            after_first["sfnode_prefix_cache_misses_total"]
            - before["sfnode_prefix_cache_misses_total"],
            1,
        )
        first_prompt = first["usage"]["prompt_tokens"]
        self.assertGreater(first_prompt, 6 * KV_BLOCK_TOKENS)

        warm, warm_prompts = await self.converse(warm_base)
        after = await self.metrics(cached)
        # converse() asks the first turn again (reused whole), then the second turn twice.
        reused = (
            after["sfnode_prefix_cache_reused_tokens_total"]
            - after_first["sfnode_prefix_cache_reused_tokens_total"]
        )
        whole_first_turn = (first_prompt - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
        whole_second_turn = (warm_prompts[1] - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
        self.assertEqual(
            after["sfnode_prefix_cache_hits_total"] - after_first["sfnode_prefix_cache_hits_total"],
            3,
        )
        # The second turn starts with the whole first turn; its seeded repeat with the whole
        # second turn (prompt and greedy answer blocks were saved by the greedy request).
        self.assertGreaterEqual(reused, 2 * whole_first_turn + whole_second_turn)
        prefilled = (
            after["sfnode_prefilled_tokens_total"] - after_first["sfnode_prefilled_tokens_total"]
        )
        self.assertEqual(prefilled, sum(warm_prompts) - reused)

        cold, cold_prompts = await self.converse(cold_base)
        self.assertEqual(cold_prompts, warm_prompts)
        self.assertEqual(
            [a["choices"][0]["message"]["content"] for a in warm],
            [a["choices"][0]["message"]["content"] for a in cold],
        )
        self.assertEqual(warm[0]["choices"][0]["message"], first["choices"][0]["message"])
        uncached_metrics = await self.metrics(uncached)
        self.assertNotIn("sfnode_prefix_cache_hits_total", uncached_metrics)
        self.assertEqual(uncached_metrics["sfnode_prefilled_tokens_total"], sum(cold_prompts))


class PlacementTests(PrefixProcessTestCase):
    async def test_requests_sharing_a_system_prompt_land_together(self) -> None:
        """Two nodes; a request with system prompt A and one with B, sent together, land on
        the two nodes; then, one at a time, three more of each (B first) land on the node
        their prompt went to first, and that node reuses the prompt's blocks every time."""
        nodes = await defer.gatherResults(
            [defer.Deferred.fromCoroutine(self.start_node(f"n{i}")) for i in range(2)]
        )
        _, fleet, _ = await self.start_head(list(nodes))
        system_a = [(5 * i) % 500 + 3 for i in range(320)]
        system_b = [(11 * i) % 500 + 3 for i in range(320)]
        together = [fleet.generate(
            HeadRequest([*system_a, 1], 4),
        ), fleet.generate(
            HeadRequest([*system_b, 1], 4),
        )]
        first = await defer.gatherResults([g.result for g in together])
        holder = {"a": first[0].node, "b": first[1].node}
        self.assertEqual(sorted(holder.values()), ["n0", "n1"])
        before = [await self.metrics(node) for node in nodes]
        landed: dict[str, list[str]] = {"a": [], "b": []}
        for i in range(2, 5):
            for name, system in (("b", system_b), ("a", system_a)):
                outcome = await fleet.generate(HeadRequest([*system, i], 4)).result
                landed[name].append(outcome.node)
        self.assertEqual(landed, {"a": [holder["a"]] * 3, "b": [holder["b"]] * 3})
        for node, old in zip(nodes, before, strict=True):
            new = await self.metrics(node)
            self.assertEqual(
                new["sfnode_prefix_cache_hits_total"] - old["sfnode_prefix_cache_hits_total"], 3
            )
            self.assertEqual(
                new["sfnode_prefix_cache_reused_tokens_total"]
                - old["sfnode_prefix_cache_reused_tokens_total"],
                3 * 320,
            )
