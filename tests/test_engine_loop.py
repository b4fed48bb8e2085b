"""The engine loop both engines run (sfnode.engines.loop), through the mock engine on a Clock.

The transformers engine's own tests (tests/test_engine.py) run the same loop over a real model;
these pin what the loop itself decides, without a model: which requests it refuses before any
step, when a step runs, what cancelling and stopping do, and the figures it reports.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.config import EngineConfig
from sfnode.engines.loop import EngineLoop, RunnerTraits
from sfnode.engines.mock import MockEngine, MockRunner, ReactorWorker
from sfnode.generation import (
    EngineRefusal,
    EngineStop,
    GenerationRequest,
    GenerationResult,
    StreamTooLong,
    TokenBatch,
)
from sfnode.linkf.wire import GenParams
from tests.nodefixture import PROMPT, expected_tokens


def started(engine: EngineLoop) -> EngineLoop:
    engine.start()
    return engine


class RefusalTests(SynchronousTestCase):
    """Requests that can never run fail at once, before any step."""

    def failure_of(self, engine: EngineLoop, context: tuple[int, ...]) -> Any:
        generation = engine.submit(GenerationRequest(context, GenParams(), 4), lambda b: None)
        return self.failureResultOf(generation.result).value

    def test_an_empty_context_a_long_one_and_an_unknown_id_are_refused(self) -> None:
        """An empty context and an id past the runner's vocabulary are EngineRefusals, a
        context longer than the window StreamTooLong with both lengths."""
        clock = Clock()
        traits = RunnerTraits(n_layers=24, vocab_size=100, eos_ids=frozenset())
        config = EngineConfig(context_window=32)
        runner = MockRunner(traits, config.max_lanes, None, True)
        loop = started(
            EngineLoop(
                config, traits, runner, ReactorWorker(clock, runner, 0.0), clock=clock.seconds
            )
        )
        self.assertIsInstance(self.failure_of(loop, ()), EngineRefusal)
        unknown = self.failure_of(loop, (5, 100))
        self.assertIsInstance(unknown, EngineRefusal)
        self.assertIn("token id 100 is outside the vocabulary of 100", str(unknown))
        too_long = self.failure_of(loop, tuple(range(33)))
        self.assertIsInstance(too_long, StreamTooLong)
        self.assertEqual((too_long.length, too_long.max), (33, 32))

    def test_the_mock_reads_any_u32_id(self) -> None:
        """The mock's contexts may hold any u32 id (a head's tokenizer may be larger than its
        vocabulary); it generates ids of its own vocabulary."""
        clock = Clock()
        engine = started(MockEngine(clock, vocab_size=50))
        got: list[int] = []
        context = (7, 2**32 - 1)
        engine.submit(GenerationRequest(context, GenParams(), 3), got.extend)
        clock.advance(0)
        self.assertEqual(got, expected_tokens(context, 3, 50))


class RestTests(SynchronousTestCase):
    """When the loop tells its worker that the work ran out (docs/engine.md section 5.3)."""

    def test_the_worker_rests_once_each_time_the_work_runs_out(self) -> None:
        """Not at start, nor between the steps of a generation, nor again while idle: once
        after a generation's last step, and once more after the next one's."""
        clock = Clock()
        engine = started(MockEngine(clock, token_delay_s=0.5))
        worker = engine.worker
        assert isinstance(worker, ReactorWorker)
        self.assertEqual(worker.rests, 0)
        for burst in (1, 2):
            results: list[GenerationResult] = []
            generation = engine.submit(GenerationRequest(PROMPT, GenParams(), 3), lambda b: None)
            generation.result.addCallback(results.append)
            steps = 0
            while not results:
                self.assertEqual(worker.rests, burst - 1)
                clock.advance(0.5)
                steps += 1
            self.assertGreater(steps, 1)
            self.assertEqual(worker.rests, burst)
            clock.advance(10.0)
            self.assertEqual(worker.rests, burst)


class StepTests(SynchronousTestCase):
    """When the mock's steps run, and what cancel and stop do."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.engine = started(MockEngine(self.clock, token_delay_s=0.5))
        self.batches: list[TokenBatch] = []
        self.results: list[GenerationResult] = []
        self.generation = self.engine.submit(
            GenerationRequest(PROMPT, GenParams(), 100), self.batches.append
        )
        self.generation.result.addCallback(self.results.append)

    def test_a_step_runs_its_delay_after_it_was_planned(self) -> None:
        """The first token (the prompt's step) comes 0.5 s after the submit, the next one
        0.5 s after that, one a step."""
        self.clock.advance(0.49)
        self.assertEqual(self.batches, [])
        self.clock.advance(0.01)
        self.assertEqual([b.tokens for b in self.batches], [tuple(expected_tokens(PROMPT, 1))])
        self.clock.advance(0.5)
        self.assertEqual([t for b in self.batches for t in b.tokens], expected_tokens(PROMPT, 2))

    def test_no_token_after_cancel_and_cancelled_after_the_step(self) -> None:
        """A cancel while a step is in flight: that step's token is not handed over, and the
        result says CANCELLED with the tokens handed over before."""
        self.clock.advance(0.5)
        self.generation.cancel()
        self.clock.advance(0.5)
        self.assertEqual(len(self.batches), 1)
        (result,) = self.results
        self.assertEqual(
            (result.stop, list(result.tokens)), (EngineStop.CANCELLED, expected_tokens(PROMPT, 1))
        )

    def test_stop_ends_everything_at_once_and_leaves_no_timer(self) -> None:
        """stop() with a step in flight and a request queued fires at once, both end
        CANCELLED, no delayed call is left, and a later submit fails."""
        queued = self.engine.submit(GenerationRequest(PROMPT, GenParams(), 5), lambda b: None)
        self.successResultOf(self.engine.stop())
        self.assertEqual(self.results[0].stop, EngineStop.CANCELLED)
        self.assertEqual(self.successResultOf(queued.result).stop, EngineStop.CANCELLED)
        self.assertEqual(self.clock.getDelayedCalls(), [])
        late = self.engine.submit(GenerationRequest(PROMPT, GenParams(), 5), lambda b: None)
        self.failureResultOf(late.result, RuntimeError)

    def test_the_figures_are_the_schedulers(self) -> None:
        """Once the prompt's step ran: one lane active, its KV blocks counted, the prompt's
        tokens prefilled, one token decoded, two steps sent (that one and the next, in flight:
        a step is counted when it is planned), and the prefix cache's figures (the mock keeps
        one, as the transformers engine does by default)."""
        self.clock.advance(0.5)
        stats = self.engine.statistics()
        self.assertEqual(
            (
                stats.lanes_active,
                stats.kv_blocks_used,
                stats.prefilled_tokens,
                stats.decoded_tokens,
            ),
            (1, 1, len(PROMPT), 1),
        )
        assert stats.steps is not None and stats.prefix is not None
        self.assertEqual((stats.steps.steps, stats.steps.speculative), (2, False))
        self.assertEqual(stats.prefix.misses, 1)
        self.assertIsNone(stats.masks)
