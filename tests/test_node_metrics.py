"""The node's ``--metrics`` page (sfnode.node.exporter) with and without a prefix cache.

Nodes here are the real service tree of ``twistd sfnode`` (``sfnode.node.tap.makeService``) on the
tiny random Llama of tests/tinymodel.py (or the mock engine), on loopback TCP; a head-side link
asks for generations and ``/metrics`` is read with an HTTP client and parsed as Prometheus text;
``/healthz`` beside it is read as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from twisted.application.service import MultiService
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, readBody

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, connect_node
from sfnode.node import tap
from tests.processes import LOOPBACK
from tests.tinymodel import save_tiny_model

PREFIX_FAMILIES = (
    "sfnode_prefix_cache_hits",
    "sfnode_prefix_cache_misses",
    "sfnode_prefix_cache_reused_tokens",
    "sfnode_prefix_cache_saved_blocks",
    "sfnode_prefix_cache_evictions",
    "sfnode_prefix_cache_blocks",
)
SHARED = [(7 * i) % 500 + 3 for i in range(64)]
"""64 tokens: four full blocks, shared by the prompts below."""
TINY_LAYERS = 3
"""The layers of tests/tinymodel.py's Llama (its default)."""


class NodeMetricsTests(TestCase):
    timeout = 120

    def start(self, *args: str) -> MultiService:
        options = tap.Options()
        options.parseOptions(
            ["--listen", LOOPBACK, "--metrics", LOOPBACK, "--identity", "metered", *args]
        )
        node = tap.makeService(options, reactor)
        node.startService()  # type: ignore[no-untyped-call]
        self.addCleanup(node.stopService)  # type: ignore[no-untyped-call]
        return node

    def tiny(self, *args: str) -> MultiService:
        folder = save_tiny_model(Path(self.mktemp()).resolve() / "tiny-llama")
        return self.start(
            "--model", str(folder), "--device", "cpu", "--threads", "1",
            "--max-context", "256", "--max-lanes", "2", *args,
        )  # fmt: skip

    async def generate(self, node: MultiService, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt in turn, 4 greedy tokens, one session each; their tokens."""
        port = node.getServiceNamed("listen").port.getHost().port  # type: ignore[no-untyped-call]
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        answers = []
        try:
            for session, prompt in enumerate(prompts, start=1):
                link.assign(session)
                link.append(session, prompt)
                answers.append(list((await link.generate(
                    session,
                    HeadRequest((), 4),
                ).result).tokens))
        finally:
            await link.close()
        return answers

    async def scrape(self, node: MultiService) -> dict[str, float]:
        """The samples of ``/metrics`` by name (one node, so one sample per name)."""
        service = node.getServiceNamed("metrics")  # type: ignore[no-untyped-call]
        url = f"http://127.0.0.1:{service.port.getHost().port}/metrics"
        response = await Agent(reactor).request(b"GET", url.encode())
        self.assertEqual(response.code, 200)
        text = (await readBody(response)).decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.assertEqual(sample.labels, {"node": "metered", "model": "tiny-llama"})
                samples[sample.name] = sample.value
        return samples

    async def test_the_prefix_cache_figures(self) -> None:
        """Two prompts sharing 64 tokens: the first misses and saves its four full blocks, the
        second hits and reuses all 64 tokens, so only 65 + 1 prompt tokens are computed; no
        block was evicted and four are held."""
        node = self.tiny()
        await self.generate(node, [[*SHARED, 11], [*SHARED, 12]])
        samples = await self.scrape(node)
        self.assertEqual(
            {name: samples[name] for name in samples if name.startswith("sfnode_prefix")},
            {
                "sfnode_prefix_cache_hits_total": 1,
                "sfnode_prefix_cache_misses_total": 1,
                "sfnode_prefix_cache_reused_tokens_total": 64,
                "sfnode_prefix_cache_saved_blocks_total": 4,
                "sfnode_prefix_cache_evictions_total": 0,
                "sfnode_prefix_cache_blocks": 4,
            },
        )
        self.assertEqual(samples["sfnode_prefilled_tokens_total"], 66)

    async def test_the_stage_prefix_pools_figures(self) -> None:
        """Two pipeline stage sessions through all the tiny model's layers whose prompts share
        64 tokens: the first misses and saves four blocks, the second takes them, so the stage
        pools count one hit of 64 rows (the engine's own cache is not touched)."""
        node = self.tiny()
        port = node.getServiceNamed("listen").port.getHost().port  # type: ignore[no-untyped-call]
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        self.addCleanup(link.close)
        tokens = []
        for session, tail in ((1, 11), (2, 12)):
            answer = await link.stage_forward([*SHARED, tail], 0, TINY_LAYERS, None, session)
            tokens.append(answer.token)
        self.assertNotIn(None, tokens)
        samples = await self.scrape(node)
        self.assertEqual(
            {name: samples[name] for name in samples if name.startswith("sfnode_stage_prefix")},
            {
                "sfnode_stage_prefix_hits_total": 1,
                "sfnode_stage_prefix_misses_total": 1,
                "sfnode_stage_prefix_reused_tokens_total": 64,
                "sfnode_stage_prefix_saved_blocks_total": 4,
                "sfnode_stage_prefix_evictions_total": 0,
                "sfnode_stage_prefix_blocks": 4,
            },
        )
        self.assertEqual(samples["sfnode_prefix_cache_hits_total"], 0)

    async def test_a_small_cache_counts_its_evictions(self) -> None:
        """With --prefix-cache-blocks 2, prompts of four blocks each evict blocks to save
        theirs; the cache never holds more than its two blocks."""
        node = self.tiny("--prefix-cache-blocks", "2")
        await self.generate(node, [[*SHARED, 11], [9, *SHARED]])
        samples = await self.scrape(node)
        self.assertGreater(samples["sfnode_prefix_cache_evictions_total"], 0)
        self.assertEqual(samples["sfnode_prefix_cache_blocks"], 2)
        self.assertEqual(samples["sfnode_prefix_cache_misses_total"], 2)

    async def test_no_prefix_figures_without_a_cache(self) -> None:
        """--no-prefix-cache shows no prefix figures (rather than zeros that would read as
        "nothing reused"), and every prompt token is computed."""
        node = self.tiny("--no-prefix-cache")
        await self.generate(node, [[*SHARED, 11], [*SHARED, 12]])
        samples = await self.scrape(node)
        self.assertFalse(
            [name for name in samples if name.startswith(("sfnode_prefix", "sfnode_stage_prefix"))]
        )
        self.assertEqual(samples["sfnode_prefilled_tokens_total"], 130)

    async def test_healthz_is_ok_until_the_drain_starts(self) -> None:
        """/healthz on the --metrics listener (the probe of deploy/kubernetes) answers 200
        "ok" with the node's identity, model, connected heads and generations while the node
        takes generations, and 503 "draining" once its drain started."""
        node = self.start("--engine", "mock")
        service = node.getServiceNamed("metrics")  # type: ignore[no-untyped-call]
        url = f"http://127.0.0.1:{service.port.getHost().port}/healthz".encode()
        port = node.getServiceNamed("listen").port.getHost().port  # type: ignore[no-untyped-call]
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        self.addCleanup(link.close)
        response = await Agent(reactor).request(b"GET", url)
        body = json.loads(await readBody(response))
        self.assertEqual(
            (response.code, body),
            (200, {"status": "ok", "node": "metered", "model": "mock", "heads": 1,
                   "generations": 0}),
        )  # fmt: skip
        agent = node.getServiceNamed("agent").agent  # type: ignore[no-untyped-call]
        agent.drain()
        response = await Agent(reactor).request(b"GET", url)
        body = json.loads(await readBody(response))
        self.assertEqual((response.code, body["status"]), (503, "draining"))

    async def test_step_and_draft_figures(self) -> None:
        """Every step-running engine shows its steps, decode rows and the tokens they gave;
        with --speculative ngram also the draft tokens verified and accepted and their ratio
        (docs/engine.md section 3.1), and a decode row then gives more than one token."""
        from tests.test_engine import draft_from_answers

        prompt = [*SHARED[:24], 5, 6]
        plain = self.tiny("--no-prefix-cache")
        (answer,) = await self.generate(plain, [prompt])
        samples = await self.scrape(plain)
        self.assertEqual(samples["sfnode_decode_row_tokens_total"], 3)
        self.assertEqual(samples["sfnode_decode_rows_total"], 3)
        self.assertEqual(samples["sfnode_tokens_per_decode_row"], 1.0)
        self.assertFalse([name for name in samples if name.startswith("sfnode_draft")])
        drafting = self.tiny("--no-prefix-cache", "--speculative", "ngram")
        engine = drafting.getServiceNamed("agent").agent.engine  # type: ignore[no-untyped-call]
        # The random tiny model seldom quotes its prompt: the drafts are its plain answers.
        draft_from_answers(engine, {tuple(prompt): answer})
        await self.generate(drafting, [prompt])
        samples = await self.scrape(drafting)
        self.assertEqual(samples["sfnode_draft_tokens_total"], 2)
        self.assertEqual(samples["sfnode_draft_accepted_tokens_total"], 2)
        self.assertEqual(samples["sfnode_draft_acceptance_ratio"], 1.0)
        self.assertEqual(samples["sfnode_decode_rows_total"], 1)
        self.assertEqual(samples["sfnode_tokens_per_decode_row"], 3.0)
