"""Real pipelines: the tiny model's layers split over stage nodes equal the full model.

A pipeline (docs/protocol.md section 7.6) runs layers ``[start, end)`` on each stage node; the
hidden state crosses the links as float32 bytes and the last stage applies the final norm and
the LM head.  These tests use the tiny Llama with random, non-unit RMSNorm weights and random
biases (``tests.tinymodel.tiny_llama_random_norms``), so that a stage that skips a norm, a bias
or the final norm computes other numbers (with unit norm weights the final norm only rescales,
and an argmax cannot tell).  They compare, against the full model in this process:

- every hidden state a stage sends on, to float tolerance, and the logits the last stage
  computes, to float tolerance (captured in process: the wire carries only the token);
- the whole greedy sequence of the pipeline, 32 tokens, with ``generate()``.

The fast tests run the stage nodes in this process (each its own NodeAgent and engine, over real
TCP); :class:`ProcessPipelineTests` runs them as real ``twistd sfnode`` processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Generator, Sequence
from io import BytesIO
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.web.client import Agent, FileBodyProducer, readBody
from twisted.web.http_headers import Headers

from sfnode.head.fleet import pipeline as pipeline_module
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.pipeline import PipelineFleet
from sfnode.head.fleet.stage_plan import StageModel
from sfnode.head.link import NodeLink
from sfnode.linkf.wire import FINISH_LENGTH
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.nodefixture import NodeTestCase, RunningNode
from tests.processes import HEAD_SERVING, LOOPBACK, Child, node_endpoint, spawn_twistd
from tests.tinymodel import TINY_EOS, TINY_VOCAB, reference_greedy, tiny_llama_random_norms

LAYERS = 4
PROMPT = [(i * 53 + 11) % TINY_VOCAB for i in range(23)]
NEW_TOKENS = 32
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
Gen = Generator[defer.Deferred[Any], Any, None]


def full_forward(model: Any, context: Sequence[int]) -> tuple[Any, list[Any]]:
    """The full model's last-position logits and its hidden state after every layer.

    ``hidden[i]`` is the output of layer ``i - 1`` for ``i`` from 1 to LAYERS - 1 (before any
    final norm), ``hidden[0]`` the embeddings: what a stage ending at layer ``i`` sends on.
    """
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([list(context)]), output_hidden_states=True)
    return out.logits[0, -1, :].to(torch.float32), [h[0] for h in out.hidden_states[:LAYERS]]


class PipelineCase(NodeTestCase):
    timeout = 240

    def setUp(self) -> None:
        super().setUp()
        self.model = tiny_llama_random_norms(layers=LAYERS)

    def assert_close(self, actual: Any, expected: Any, what: str) -> None:
        import torch

        try:
            torch.testing.assert_close(actual, expected, **TOLERANCE)
        except AssertionError as e:
            self.fail(f"{what}: {e}")

    @defer.inlineCallbacks
    def start_stage(
        self, name: str
    ) -> Generator[defer.Deferred[Any], Any, tuple[RunningNode, Any]]:
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine

        model = tiny_llama_random_norms(layers=LAYERS)
        engine = TransformersEngine(model, reactor, EngineConfig(max_lanes=4))
        agent = NodeAgent(
            reactor, engine, NodeConfig(identity=name, model_name="tiny", listens=True)
        )
        agent.start()
        endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
        factory = node_factory(agent)
        port = yield endpoint.listen(factory)
        self.addCleanup(agent.stop)
        self.addCleanup(port.stopListening)
        return RunningNode(agent, engine, port, factory), model  # type: ignore[arg-type]

    @defer.inlineCallbacks
    def started_pipeline(
        self,
        stages: int,
        boundaries: Sequence[int] | None,
        spares: int = 0,
        rates: Sequence[int] = (),
        sizes: StageModel | None = None,
        rings: bool = True,
    ) -> Generator[defer.Deferred[Any], Any, tuple[list[RunningNode], PipelineFleet]]:
        """``stages`` stage nodes and ``spares`` more (:meth:`start_stage`), each reporting
        the decode rate ``rates`` gives it (none: 0), and a started pipeline over the first
        ``stages`` of them cut at ``boundaries`` (None: planned over LAYERS layers of
        ``sizes``), the others its spares (stopped at the end), its steps in stage rings when
        ``rings`` (docs/protocol.md section 12.10); fires with every node and the pipeline."""
        nodes = []
        for i in range(stages + spares):
            node = (yield self.start_stage(f"stage{i}"))[0]
            if i < len(rates):
                node.agent.reports.load.rates.decode_tokens_per_s = rates[i]
            nodes.append(node)
        pipeline = PipelineFleet(
            reactor,
            [node.endpoint for node in nodes[:stages]],
            boundaries=boundaries,
            n_layers=LAYERS if boundaries is None else None,
            sizes=sizes,
            ids=self.ids,
            spares=[node.endpoint for node in nodes[stages:]],
            rings=rings,
        )
        self.addCleanup(pipeline.stop)
        yield pipeline.start()
        return nodes, pipeline

    @defer.inlineCallbacks
    def compare_boundaries(
        self, links: Sequence[NodeLink], ranges: Sequence[tuple[int, int]]
    ) -> Gen:
        """Walk PROMPT through the stages by hand: each hidden state a stage sends on equals
        the full model's after that layer, and the last stage answers the full model's argmax."""
        from sfnode.engines.transformers_engine import decode_hidden

        logits, hidden_states = full_forward(self.model, PROMPT)
        hidden: bytes | None = None
        for i, (link, (start, end)) in enumerate(zip(links, ranges, strict=True)):
            response = yield link.stage_forward(PROMPT if i == 0 else (), start, end, hidden)
            if end < LAYERS:
                self.assertIsNone(response.token)
                self.assertIsNotNone(response.hidden)
                received = decode_hidden(response.hidden, self.model.config.hidden_size)
                self.assert_close(received, hidden_states[end], f"hidden after layer {end - 1}")
                hidden = response.hidden
            else:
                self.assertIsNone(response.hidden)
                self.assertEqual(response.token, int(logits.argmax()))

    @defer.inlineCallbacks
    def run_pipeline(
        self, endpoints: Sequence[str], boundaries: Sequence[int]
    ) -> Generator[defer.Deferred[Any], Any, tuple[list[int], int]]:
        pipeline = PipelineFleet(
            reactor, endpoints, boundaries=boundaries, eos_ids=[TINY_EOS], ids=self.ids
        )
        self.addCleanup(pipeline.stop)
        yield pipeline.start()
        streamed: list[int] = []
        outcome = yield pipeline.generate(
            HeadRequest(PROMPT, NEW_TOKENS),
            on_tokens=streamed.extend,
        ).result
        self.assertEqual(streamed, outcome.tokens)
        links = []
        for node in pipeline.stages:
            yield node.link.when_open()
            links.append(node.link)
        yield self.compare_boundaries(links, pipeline.ranges)
        return list(outcome.tokens), outcome.finish


class InProcessPipelineTests(PipelineCase):
    """Stage nodes in this process, each with its own engine and copy of the model, over TCP."""

    def capture_logits(self, engine: Any) -> list[Any]:
        """Record the last row of every logits tensor the engine's runner computes (the last
        stage's next-token logits)."""
        captured: list[Any] = []
        runner = engine.runner
        logits_of = runner._logits

        def recording(*args: Any, **kwargs: Any) -> Any:
            out = logits_of(*args, **kwargs)
            captured.append(out.detach()[-1].clone())
            return out

        runner._logits = recording
        return captured

    @defer.inlineCallbacks
    def check(self, boundaries: Sequence[int]) -> Gen:
        stages = []
        for i in range(len(boundaries)):
            stages.append((yield self.start_stage(f"stage{i}")))
        # After the engine's start-up check of exactness, whose steps are none of the pipeline's.
        yield stages[-1][0].engine.exactness
        captured = self.capture_logits(stages[-1][0].engine)
        tokens, finish = yield self.run_pipeline([s.endpoint for s, _ in stages], boundaries)
        expected = reference_greedy(self.model, PROMPT, NEW_TOKENS)
        self.assertEqual(tokens, expected)
        self.assertEqual(finish, FINISH_LENGTH)
        # One logits row per generated token, then one for compare_boundaries' walk.
        self.assertEqual(len(captured), len(tokens) + 1)
        context = list(PROMPT)
        for step, token in enumerate(tokens):
            logits, _ = full_forward(self.model, context)
            self.assert_close(captured[step], logits, f"last stage logits at step {step}")
            context.append(token)

    def test_two_even_stages_equal_the_full_model(self) -> defer.Deferred[None]:
        """Layers [0, 2) and [2, 4) on two nodes: the hidden state sent on and the last stage's
        logits equal the full model's to float tolerance, at every one of 32 steps, and the
        whole greedy sequence equals generate()."""
        return self.check([2, 4])

    def test_three_uneven_stages_equal_the_full_model(self) -> defer.Deferred[None]:
        """Layers [0, 1), [1, 3), [3, 4) on three nodes: the same comparisons."""
        return self.check([1, 3, 4])


class ProcessPipelineTests(PipelineCase):
    """Three real ``twistd sfnode --engine transformers`` processes as the stages."""

    @defer.inlineCallbacks
    def test_three_stage_processes_equal_the_full_model(self) -> Gen:
        """Three ``twistd sfnode`` processes serving the saved tiny model (random norms) as
        stages [0, 1), [1, 3), [3, 4): every hidden state they send on equals the full model's
        to float tolerance, and the whole greedy sequence of 32 tokens equals generate()."""
        from tests.tinymodel import save_tiny_random_norms_model

        folder = save_tiny_random_norms_model(self.mktemp(), layers=LAYERS)
        children = [
            spawn_twistd(
                self,
                Child(f"stage{i}"),
                ["sfnode", "--listen", LOOPBACK, "--engine", "transformers",
                 "--model", str(folder.resolve()), "--identity", f"stage{i}",
                 "--max-lanes", "1", "--threads", "1"],
            )
            for i in range(3)
        ]  # fmt: skip
        endpoints = []
        for child in children:
            (bound,) = yield child.wait_for(rb"sfnode listening on 127\.0\.0\.1:(\d+)\n")
            endpoints.append(f"tcp:127.0.0.1:{int(bound.group(1))}")
        tokens, finish = yield self.run_pipeline(endpoints, [1, 3, 4])
        self.assertEqual(tokens, reference_greedy(self.model, PROMPT, NEW_TOKENS))
        self.assertEqual(finish, FINISH_LENGTH)
        for child in children:
            self.assertNotIn(b"Traceback", bytes(child.output))


class KeptStageTests(PipelineCase):
    """Stages that keep their KV (docs/protocol.md section 12.8): a prompt longer than a
    prefill chunk goes through once, each step then sends one row (in the stage ring, 12.10,
    or through the head), and a stage torn down in the middle of generations is rebuilt with
    nothing repeated or lost."""

    @defer.inlineCallbacks
    def generate(
        self, pipeline: PipelineFleet, prompt: list[int]
    ) -> Generator[defer.Deferred[Any], Any, list[int]]:
        streamed: list[int] = []
        outcome = yield pipeline.generate(
            HeadRequest(prompt, NEW_TOKENS), on_tokens=streamed.extend
        ).result
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        return list(outcome.tokens)

    def test_a_long_prompt_in_chunks_then_one_row_per_token(self) -> defer.Deferred[None]:
        """A 150-token prompt in chunks of 64 through stages [0, 2) and [2, 4) gives the
        greedy tokens of generate(); the hidden states sent between the stages are the
        prompt's rows once and then one row per token (hidden size 64, float32: 256 bytes of
        data and a few of framing per row), every step after the first in the stage ring
        (docs/protocol.md section 12.10), and every stage session is released at the end."""
        return self.long_prompt_then_rows(rings=True)

    def test_without_rings_every_step_goes_through_the_head(self) -> defer.Deferred[None]:
        """The same with ``rings=False`` (``sfhead --no-stage-ring``): the same tokens, each
        step through the head's step groups (12.8)."""
        return self.long_prompt_then_rows(rings=False)

    @defer.inlineCallbacks
    def long_prompt_then_rows(self, rings: bool) -> Gen:
        self.patch(pipeline_module, "PREFILL_CHUNK", 64)
        stages, pipeline = yield self.started_pipeline(2, [2, 4], rings=rings)
        prompt = [(i * 31 + 7) % TINY_VOCAB for i in range(150)]
        tokens = yield self.generate(pipeline, prompt)
        self.assertEqual(tokens, reference_greedy(self.model, prompt, NEW_TOKENS))
        ring = pipeline.ring
        self.assertEqual(0 if ring is None else ring.tokens, NEW_TOKENS - 1 if rings else 0)
        rows = len(prompt) + NEW_TOKENS - 1
        self.assertGreaterEqual(pipeline.bytes_forwarded, rows * 256)
        self.assertLess(pipeline.bytes_forwarded, rows * 256 + 40 * (3 + NEW_TOKENS))
        yield deferLater(reactor, 0.05, lambda: None)
        for stage in stages:
            self.assertEqual(len(stage.engine.kept_stages.sessions), 0)

    @defer.inlineCallbacks
    def test_a_stage_torn_down_mid_generation_is_rebuilt_exactly(self) -> Gen:
        """Three generations at once over stages [0, 1) and [1, 4); once 10 tokens of the
        first have streamed, the second stage's node is torn down (its connections aborted,
        its port closed) and a new one, with a new engine and no KV, listens on the same port:
        every stream completes with exactly generate()'s tokens, each delivered once."""
        stages, pipeline = yield self.started_pipeline(2, [1, 4])
        prompts = [[(i * 53 + 11 * k) % TINY_VOCAB for i in range(23 + k)] for k in range(3)]
        yield self.generate_through_a_fault(pipeline, prompts, lambda: self.replace(stages[1]))

    @defer.inlineCallbacks
    def test_a_stage_torn_down_mid_ring_is_rebuilt_exactly(self) -> Gen:
        """One generation, alone, so its steps run in the stage ring (docs/protocol.md
        section 12.10); once 10 tokens have streamed, the last stage's node is replaced as
        above: the ring breaks, the head rebuilds the stages from the context it holds, the
        steps go back to the ring, and the stream is exactly generate()'s, each token once."""
        stages, pipeline = yield self.started_pipeline(2, [1, 4])
        yield self.generate_through_a_fault(pipeline, [PROMPT], lambda: self.replace(stages[1]))
        assert pipeline.ring is not None
        self.assertGreater(pipeline.ring.tokens, 10)
        self.assertEqual(pipeline.ring.joined, 2)

    @defer.inlineCallbacks
    def test_a_dead_stages_layers_go_to_a_spare(self) -> Gen:
        """Two generations over stages [0, 2) and [2, 4) with a spare node; once 10 tokens
        have streamed, the second stage's node is torn down and never comes back: its layers go
        to the spare, which rebuilds them from the context the head holds, and both streams
        complete with exactly generate()'s tokens, each delivered once."""
        nodes, pipeline = yield self.started_pipeline(2, [2, 4], spares=1)
        prompts = [PROMPT, PROMPT[3:]]
        yield self.generate_through_a_fault(pipeline, prompts, lambda: self.tear_down(nodes[1]))
        self.assertEqual(pipeline.stages[1].name, pipeline.fleet.nodes[2].name)
        self.assertIn(pipeline.fleet.nodes[1], pipeline.spares)

    @defer.inlineCallbacks
    def test_a_dead_stage_of_a_ring_goes_to_a_spare(self) -> Gen:
        """The same for one generation in the stage ring: the ring is joined again over the
        spare (its neighbours given the spare's endpoint) and the stream is exact."""
        nodes, pipeline = yield self.started_pipeline(2, [2, 4], spares=1)
        yield self.generate_through_a_fault(pipeline, [PROMPT], lambda: self.tear_down(nodes[1]))
        self.assertEqual(pipeline.stages[1].name, pipeline.fleet.nodes[2].name)
        assert pipeline.ring is not None
        self.assertGreater(pipeline.ring.tokens, 10)
        self.assertEqual(pipeline.ring.joined, 2)

    @defer.inlineCallbacks
    def generate_through_a_fault(
        self,
        pipeline: PipelineFleet,
        prompts: list[list[int]],
        fault: Callable[[], Coroutine[Any, Any, None]],
    ) -> Gen:
        """Generate for every prompt at once; ``fault`` runs once 10 tokens of the first have
        streamed.  Every stream must equal generate()'s, and the first's tokens must have
        streamed exactly once, in order."""
        faults: list[defer.Deferred[None]] = []
        streamed: list[int] = []

        def tokens(batch: Any) -> None:
            streamed.extend(batch)
            if len(streamed) >= 10 and not faults:
                faults.append(defer.ensureDeferred(fault()))

        running = [
            pipeline.generate(HeadRequest(p, NEW_TOKENS), on_tokens=None if k else tokens)
            for k, p in enumerate(prompts)
        ]
        outcomes = yield defer.gatherResults([g.result for g in running])
        yield faults[0]
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            self.assertEqual(outcome.tokens, reference_greedy(self.model, prompt, NEW_TOKENS))
        self.assertEqual(streamed, outcomes[0].tokens)

    async def tear_down(self, stage: RunningNode) -> None:
        """Abort ``stage``'s connections, close its port and stop its node."""
        for protocol in list(stage.node_factory.protocols):
            protocol.transport.abortConnection()
        await stage.port.stopListening()
        await stage.agent.stop()

    async def replace(self, stage: RunningNode) -> None:
        """Tear ``stage`` down and start a new node on its port."""
        number = stage.port_number
        await self.tear_down(stage)
        await deferLater(reactor, 0.3, lambda: None)
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine

        engine = TransformersEngine(
            tiny_llama_random_norms(layers=LAYERS), reactor, EngineConfig(max_lanes=4)
        )
        agent = NodeAgent(
            reactor, engine, NodeConfig(identity="stage1-again", model_name="tiny", listens=True)
        )
        await self.serve(agent, engine, number)


class PlanTests(PipelineCase):
    """Stage boundaries chosen by the stage nodes' reports (sfnode.head.fleet.stage_plan), and
    the plan shown in ``/metrics`` and the console's state."""

    @defer.inlineCallbacks
    def test_a_faster_stage_takes_more_layers(self) -> Gen:
        """Two stage nodes reporting decode rates of 30 and 10 tokens/s and no boundaries
        given: the first takes three of the four layers, the status the metrics read names
        each stage's node and layers as planned, and the greedy tokens are still
        generate()'s."""
        _, pipeline = yield self.started_pipeline(2, None, rates=[30, 10])
        self.assertEqual(pipeline.ranges, [(0, 3), (3, 4)])
        self.assertEqual(
            [(s.stage, s.node, s.start, s.end, s.planned) for s in pipeline.status().stages],
            [(0, "stage0", 0, 3, "planned"), (1, "stage1", 3, 4, "planned")],
        )
        outcome = yield pipeline.generate(HeadRequest(PROMPT, NEW_TOKENS)).result
        self.assertEqual(list(outcome.tokens), reference_greedy(self.model, PROMPT, NEW_TOKENS))

    @defer.inlineCallbacks
    def test_memory_bounds_a_faster_stage(self) -> Gen:
        """The same rates, 30 and 10 tokens/s, but layers of 45% of the host's memory each
        (what a node reports as its host's, less its resident memory): no node holds three, so
        the faster one takes two, as planned."""
        import psutil

        total = psutil.virtual_memory().total
        sizes = StageModel(LAYERS, layer_bytes=int(total * 0.45))
        _, pipeline = yield self.started_pipeline(2, None, rates=[30, 10], sizes=sizes)
        self.assertEqual(pipeline.ranges, [(0, 2), (2, 4)])
        self.assertEqual({s.planned for s in pipeline.status().stages}, {"planned"})

    @defer.inlineCallbacks
    def test_nodes_that_cannot_hold_the_model_keep_even_boundaries(self) -> Gen:
        """Layers as large as a host's whole memory: the planner's error leaves the split
        even, said so."""
        import psutil

        sizes = StageModel(LAYERS, layer_bytes=psutil.virtual_memory().total + 1)
        _, pipeline = yield self.started_pipeline(2, None, rates=[30, 10], sizes=sizes)
        self.assertEqual(pipeline.ranges, [(0, 2), (2, 4)])
        self.assertEqual({s.planned for s in pipeline.status().stages}, {"even"})

    @defer.inlineCallbacks
    def test_given_boundaries_are_kept(self) -> Gen:
        """Boundaries given (--pipeline-layers 1,4) stay as given whatever the stages report."""
        _, pipeline = yield self.started_pipeline(2, [1, 4], rates=[30, 10])
        yield pipeline.generate(HeadRequest(PROMPT, 2)).result
        self.assertEqual(pipeline.ranges, [(0, 1), (1, 4)])
        self.assertEqual({s.planned for s in pipeline.status().stages}, {"given"})

    @defer.inlineCallbacks
    def test_nothing_reported_keeps_even_boundaries(self) -> Gen:
        """No stage has a decode rate and the layer size is unknown (no config): the layers
        are split evenly, and said so."""
        _, pipeline = yield self.started_pipeline(2, None)
        self.assertEqual(pipeline.ranges, [(0, 2), (2, 4)])
        self.assertEqual({s.planned for s in pipeline.status().stages}, {"even"})

    @defer.inlineCallbacks
    def test_a_head_process_shows_its_plan(self) -> Gen:
        """``twistd sfhead --pipeline`` over two real ``twistd sfnode`` stage processes, the
        layer count and sizes read from the model's config.json: once the stages joined,
        ``/metrics`` has each stage's first layer, end layer and layer count labelled by stage
        and node, and ``/console/state`` a ``pipeline`` entry with each stage's node and
        layers; a completion then runs through them."""
        from tests.tinymodel import save_tiny_random_norms_model

        folder = str(save_tiny_random_norms_model(self.mktemp(), layers=LAYERS).resolve())
        nodes = [
            spawn_twistd(
                self,
                Child(f"stage{i}"),
                ["sfnode", "--listen", LOOPBACK, "--engine", "transformers", "--model", folder,
                 "--identity", f"stage{i}", "--max-lanes", "1", "--threads", "1"],
            )
            for i in range(2)
        ]  # fmt: skip
        endpoints = yield defer.gatherResults([node_endpoint(node) for node in nodes])
        head = spawn_twistd(
            self,
            Child("head"),
            ["sfhead", "--http", LOOPBACK, "--model", folder, "--model-name", "tiny",
             "--pipeline", ",".join(endpoints)],
        )  # fmt: skip
        found = yield head.wait_for(HEAD_SERVING)
        base = f"http://127.0.0.1:{int(found[0].group(1))}"
        yield head.wait_for(rb"pipeline stage stage1: layers \[2, 4\), planned by ")
        agent = Agent(reactor)
        metrics = yield readBody((yield agent.request(b"GET", f"{base}/metrics".encode())))
        for stage, node, first, end in [(0, "stage0", 0, 2), (1, "stage1", 2, 4)]:
            labels = f'{{node="{node}",stage="{stage}"}}'
            for name, value in [("first_layer", first), ("end_layer", end), ("layers", 2)]:
                self.assertIn(f"sfhead_stage_{name}{labels} {value}.0\n".encode(), metrics)
        state = json.loads(
            (yield readBody((yield agent.request(b"GET", f"{base}/console/state".encode()))))
        )
        self.assertEqual(
            state["pipeline"],
            [
                {"stage": 0, "node": "stage0", "first_layer": 0, "end_layer": 2, "layers": 2,
                 "boundaries": "planned"},
                {"stage": 1, "node": "stage1", "first_layer": 2, "end_layer": 4, "layers": 2,
                 "boundaries": "planned"},
            ],
        )  # fmt: skip
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8}).encode()
        response = yield agent.request(
            b"POST",
            f"{base}/v1/completions".encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(body)),
        )
        self.assertEqual(response.code, 200)
        answer = json.loads((yield readBody(response)))
        self.assertEqual(answer["usage"]["completion_tokens"], 8)
        for child in [*nodes, head]:
            self.assertNotIn(b"Traceback", bytes(child.output))
