"""Tests of the exact sampler and of the transformers engine on a tiny random Llama.

The engine tests run the real reactor and the engine's real worker thread, and compare against
transformers' own ``generate(do_sample=False)`` and against the engine's own solo runs.  They must
never download anything (the model is built from a config) and never sleep.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import torch
from twisted.internet import defer, reactor
from twisted.trial import unittest

from sfnode.decoding.sampler import (
    candidates,
    draw,
    draw_position,
    greedy_token,
    sample_token,
    sample_tokens,
    splitmix64,
    uniform,
)
from sfnode.engines.config import EngineConfig
from sfnode.engines.kernels.torch_ops import onednn_linear_works
from sfnode.engines.scheduling.pace import PRIOR, StepCost, StepRates
from sfnode.engines.transformers_engine import (
    TransformersEngine,
    decode_hidden,
    encode_hidden,
    eos_ids_of,
)
from sfnode.generation import (
    EngineRefusal,
    EngineStop,
    GenerationRequest,
    GenerationResult,
    StageForward,
    StageForwardError,
    StreamTooLong,
    TokenBatch,
)
from sfnode.linkf.wire import GenParams
from tests.tinymodel import TINY_VOCAB, reference_greedy, tiny_llama, tiny_llama_random_norms

torch.set_num_threads(1)

_MODELS: dict[tuple[Any, ...], Any] = {}


def model(**kwargs: Any) -> Any:
    """A cached tiny Llama per set of arguments (built once per test run)."""
    key = tuple(sorted(kwargs.items()))
    if key not in _MODELS:
        _MODELS[key] = tiny_llama(**kwargs)
    return _MODELS[key]


def random_norms_model() -> Any:
    """The tiny Llama with random norm weights and biases (built once per test run)."""
    key = ("random-norms",)
    if key not in _MODELS:
        _MODELS[key] = tiny_llama_random_norms()
    return _MODELS[key]


def prompts(n: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    """``n`` random prompts (ids 3..vocab-1, so no EOS inside) of lengths in [low, high)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(low, high))] for _ in range(n)
    ]


SAMPLED = GenParams(temperature=0.9, top_p=0.95, min_p=0.02, top_k=64, seed=77)


def spy_on_plans(engine: TransformersEngine) -> list[Any]:
    """Record every plan the engine sends to its worker as a step (the list fills as steps are
    sent; the runner's start-up check is no step)."""
    plans: list[Any] = []
    original = engine.worker.step

    def step(plan: Any) -> Any:
        plans.append(plan)
        return original(plan)

    engine.worker.step = step  # type: ignore[method-assign]
    return plans


# -- the sampler ----------------------------------------------------------------------------


def reference_sample(logits: Sequence[float], params: GenParams, position: int) -> int:
    """docs/engine.md section 2 written out literally in Python floats (the test oracle)."""
    if params.temperature <= 0:
        best = max(logits)
        return logits.index(best)
    t = torch.tensor(logits, dtype=torch.float32)
    probs = torch.softmax(t / torch.tensor(params.temperature, dtype=torch.float32), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if params.top_k > 0:
        order = order[: params.top_k]
    if params.min_p > 0:
        pmax = probs[order[0]]
        order = [i for i in order if probs[i] >= params.min_p * pmax] or order[:1]
    if params.top_p <= 0:
        order = order[:1]
    elif params.top_p < 1:
        running = 0.0
        for n, i in enumerate(order):
            running += probs[i]
            if running >= params.top_p:
                order = order[: n + 1]
                break
    target = uniform(position) * sum(probs[i] for i in order)
    for i in order:
        if target < probs[i]:
            return i
        target -= probs[i]
    return [i for i in order if probs[i] > 0][-1]


class SamplerTests(unittest.SynchronousTestCase):
    """The pure sampler: splitmix64 uniform, the filters and the draw (docs/engine.md section 2)."""

    def test_uniform_known_vector(self) -> None:
        """uniform(0) is splitmix64 of state 0 (0xE220A8397B1DCDAF), shifted right 11, over 2^53."""
        self.assertEqual(splitmix64(0), 0xE220A8397B1DCDAF)
        self.assertEqual(uniform(0), (0xE220A8397B1DCDAF >> 11) / 2.0**53)

    def test_uniform_is_deterministic_and_in_range(self) -> None:
        """uniform() is a pure function of position, in [0, 1), wrapping mod 2^64."""
        values = [uniform(p) for p in range(1000)]
        self.assertEqual(values, [uniform(p) for p in range(1000)])
        self.assertTrue(all(0.0 <= v < 1.0 for v in values))
        self.assertGreater(len(set(values)), 990)
        self.assertEqual(uniform(2**64 + 5), uniform(5))
        self.assertEqual(draw_position(2**64 - 1, 3, 2), 4)

    def test_greedy_ties_go_to_lowest_id(self) -> None:
        """Temperature 0 is argmax, and equal logits pick the lowest id."""
        logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
        self.assertEqual(greedy_token(logits), 1)
        self.assertEqual(sample_token(logits, GenParams(), 12345), 1)

    def test_sort_ties_by_lower_id(self) -> None:
        """Candidates of equal probability are ordered by lower id."""
        logits = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0])
        ids, _ = candidates(logits, GenParams(temperature=1.0, top_p=1.0))
        self.assertEqual(ids.tolist(), [1, 2, 4, 0, 3])

    def test_top_k(self) -> None:
        """top_k keeps the k most probable candidates; 0 keeps all."""
        logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
        ids, _ = candidates(logits, GenParams(temperature=1.0, top_p=1.0, top_k=2))
        self.assertEqual(ids.tolist(), [1, 3])
        ids, _ = candidates(logits, GenParams(temperature=1.0, top_p=1.0, top_k=0))
        self.assertEqual(ids.tolist(), [1, 3, 2, 0])

    def test_min_p(self) -> None:
        """min_p keeps candidates with p >= min_p * p_max."""
        logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
        ids, _ = candidates(logits, GenParams(temperature=1.0, top_p=1.0, min_p=0.5))
        self.assertEqual(ids.tolist(), [0, 1])
        ids, _ = candidates(logits, GenParams(temperature=1.0, top_p=1.0, min_p=0.2))
        self.assertEqual(ids.tolist(), [0, 1, 2])

    def test_top_p(self) -> None:
        """top_p keeps through the first candidate where the running sum reaches it."""
        logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
        cases = {0.75: [0, 1], 0.4: [0], 0.9: [0, 1, 2], 0.0: [0], 1.0: [0, 1, 2, 3]}
        for top_p, expected in cases.items():
            ids, probs = candidates(logits, GenParams(temperature=1.0, top_p=top_p))
            self.assertEqual(ids.tolist(), expected, top_p)
            self.assertEqual(len(probs), len(expected))

    def test_draw_walk(self) -> None:
        """The draw walks the kept candidates subtracting probabilities until target < p."""
        ids = torch.tensor([7, 3, 9])
        probs = torch.tensor([0.5, 0.3, 0.0])
        # total 0.8: u=0.5 -> target 0.4 < 0.5 -> first; u=0.7 -> 0.56 -> second.
        self.assertEqual(draw(ids, probs, 0.5), 7)
        self.assertEqual(draw(ids, probs, 0.7), 3)
        # Running off the end takes the last candidate with a non-zero probability.
        self.assertEqual(draw(ids, probs, 1.0), 3)

    def test_matches_literal_reference(self) -> None:
        """The vectorised sampler equals a literal transcription of docs/engine.md section 2 on
        random rows."""
        rng = random.Random(3)
        gen = torch.Generator().manual_seed(3)
        for n in range(300):
            logits = (torch.randn(64, generator=gen) * rng.choice([0.5, 2.0, 5.0])).tolist()
            params = GenParams(
                temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
                top_p=rng.choice([0.0, 0.5, 0.9, 1.0]),
                min_p=rng.choice([0.0, 0.05, 0.3]),
                top_k=rng.choice([0, 1, 5, 40]),
                seed=rng.randrange(2**64),
            )
            position = draw_position(params.seed, 10, n)
            row = torch.tensor(logits, dtype=torch.float32)
            self.assertEqual(
                sample_token(row, params, position),
                reference_sample(logits, params, position),
                (n, params),
            )

    def test_batch_rows_are_independent(self) -> None:
        """sample_tokens on a batch gives each row what sample_token gives it alone."""
        gen = torch.Generator().manual_seed(5)
        logits = torch.randn(4, 50, generator=gen) * 3
        params = [GenParams(), SAMPLED, GenParams(temperature=1.0, top_p=1.0, seed=9), SAMPLED]
        positions = [1, 2, 3, 4]
        alone = [sample_token(logits[i], params[i], positions[i]) for i in range(4)]
        self.assertEqual(sample_tokens(logits, params, positions), alone)


# -- the engine ------------------------------------------------------------------------------


class Recorder:
    """Records on_tokens batches; can cancel its generation after ``cancel_after`` tokens."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.cancel_after = cancel_after
        self.generation: Any = None
        self.calls_after_cancel = 0
        self.cancelled = False
        self.samples: list[Any] = []
        self.engine: TransformersEngine | None = None

    def __call__(self, tokens: Sequence[int]) -> None:
        if self.cancelled:
            self.calls_after_cancel += 1
        self.batches.append(list(tokens))
        if self.engine is not None:
            self.samples.append(self.engine.statistics())
        if self.cancel_after is not None and self.count >= self.cancel_after:
            self.cancelled = True
            self.generation.cancel()

    @property
    def count(self) -> int:
        return sum(len(b) for b in self.batches)

    @property
    def tokens(self) -> list[int]:
        return [t for b in self.batches for t in b]


class TaggedRecorder(Recorder):
    """A recorder that also appends its tag to a shared list, one entry per token."""

    def __init__(self, tag: str, order: list[str]) -> None:
        super().__init__()
        self.tag = tag
        self.order = order

    def __call__(self, tokens: Sequence[int]) -> None:
        self.order.extend(self.tag for _ in tokens)
        super().__call__(tokens)


class EngineTestCase(unittest.TestCase):
    """Base: a started engine on a tiny Llama, stopped after each test."""

    model_kwargs: dict[str, Any] = {}
    engine_kwargs: dict[str, Any] = {"max_lanes": 4}

    def setUp(self) -> None:
        self.model = model(**self.model_kwargs)
        self.engine = self.make_engine(**self.engine_kwargs)

    def make_engine(self, model: Any = None, **kwargs: Any) -> TransformersEngine:
        """A started engine; batch requests may use every lane unless a test keeps some for
        interactive requests (the engine's own default keeps one)."""
        kwargs.setdefault("interactive_lanes", 0)
        engine = TransformersEngine(
            model if model is not None else self.model, reactor, EngineConfig(**kwargs)
        )
        engine.start()
        self.addCleanup(engine.stop)
        return engine

    def run_one(
        self,
        context: Sequence[int],
        max_new: int,
        params: GenParams | None = None,
        engine: TransformersEngine | None = None,
        recorder: Recorder | None = None,
        max_wall_ms: int = 0,
    ) -> tuple[defer.Deferred[GenerationResult], Recorder]:
        engine = engine or self.engine
        rec = recorder or Recorder()
        request = GenerationRequest(list(context), params or GenParams(), max_new, max_wall_ms)
        generation = engine.submit(request, rec)
        rec.generation = generation
        return generation.result, rec


class GreedyTests(EngineTestCase):
    """Greedy decoding equals transformers' generate(), alone and in concurrent lanes."""

    @defer.inlineCallbacks
    def test_greedy_equals_generate(self) -> Any:
        """Greedy tokens equal model.generate(do_sample=False) for several prompts, one by one."""
        for prompt in prompts(4, seed=1):
            expected = reference_greedy(self.model, prompt, 30)
            d, rec = self.run_one(prompt, 30)
            result = yield d
            self.assertEqual(list(result.tokens), expected)
            self.assertEqual(rec.tokens, expected)
            stop = EngineStop.EOS if expected[-1] in self.engine.eos_ids else EngineStop.LENGTH
            self.assertEqual(result.stop, stop)

    @defer.inlineCallbacks
    def test_greedy_equals_generate_on_stock_kernels(self) -> Any:
        """The model's own forward on stock kernels (--stock-kernels) gives generate()'s
        tokens; with oneDNN allowed, that path routes every float32 linear layer to it."""
        stock = self.make_engine(max_lanes=4, onednn=False, lean_step=False)
        self.assertFalse(stock.lean_step)
        self.assertEqual(stock.weights.onednn_layers, 0)
        if onednn_linear_works():
            routed = self.make_engine(max_lanes=4, lean_step=False, model=model(layers=2))
            linears = sum(isinstance(m, torch.nn.Linear) for m in model(layers=2).modules())
            self.assertEqual(routed.weights.onednn_layers, linears)
        for prompt in prompts(3, seed=5):
            d, _ = self.run_one(prompt, 20, engine=stock)
            result = yield d
            self.assertEqual(list(result.tokens), reference_greedy(self.model, prompt, 20))

    @defer.inlineCallbacks
    def test_eight_concurrent_equal_their_solo_runs(self) -> Any:
        """Eight concurrent generations (4 lanes, mixed lengths, budgets, greedy and seeded)
        give each exactly its solo result, and tokens stream in order exactly once."""
        ps = prompts(8, seed=2, low=3, high=120)
        budgets = [5, 40, 17, 60, 1, 33, 25, 50]
        params = [GenParams() if i % 2 == 0 else SAMPLED for i in range(8)]
        solo = []
        for p, b, gp in zip(ps, budgets, params, strict=True):
            d, _ = self.run_one(p, b, gp)
            solo.append((yield d))
        runs = [self.run_one(p, b, gp) for p, b, gp in zip(ps, budgets, params, strict=True)]
        results = yield defer.gatherResults([d for d, _ in runs])
        for i, (result, (_, rec)) in enumerate(zip(results, runs, strict=True)):
            self.assertEqual(result, solo[i], i)
            self.assertEqual(rec.tokens, list(result.tokens), i)
            if params[i].greedy:
                self.assertEqual(
                    list(result.tokens), reference_greedy(self.model, ps[i], budgets[i])
                )

    @defer.inlineCallbacks
    def test_model_forward_gives_the_llama_runner_tokens(self) -> Any:
        """The model's own forward (lean_step=False) gives the same tokens, concurrent lanes
        included, as the Llama runner, whose steps carry joining lanes' prompt chunks in the
        same pass as the running lanes' decode rows."""
        self.assertTrue(self.engine.lean_step)
        plans = spy_on_plans(self.engine)
        plain = self.make_engine(max_lanes=4, lean_step=False)
        self.assertFalse(plain.lean_step)
        ps = prompts(5, seed=9, low=3, high=90)
        params = [GenParams() if i % 2 == 0 else SAMPLED for i in range(5)]
        results = []
        for engine in (self.engine, plain):
            runs = [
                self.run_one(p, 24, gp, engine=engine) for p, gp in zip(ps, params, strict=True)
            ]
            results.append((yield defer.gatherResults([d for d, _ in runs])))
        self.assertEqual(results[0], results[1])
        self.assertTrue(any(plan.decode and plan.chunks for plan in plans))

    @defer.inlineCallbacks
    def test_chunked_prefill_keeps_lanes_streaming(self) -> Any:
        """A long prompt is prefilled in chunks between decode steps: a running lane keeps
        getting tokens meanwhile, and both results still equal generate()."""
        engine = self.make_engine(max_lanes=2, prefill_chunk=8)
        short, long_prompt = [5, 6, 7], prompts(1, seed=11, low=100, high=101)[0]
        order: list[str] = []
        first = self.run_one(short, 40, engine=engine, recorder=TaggedRecorder("a", order))[0]
        second = self.run_one(long_prompt, 10, engine=engine, recorder=TaggedRecorder("b", order))[
            0
        ]
        a, b = yield defer.gatherResults([first, second])
        self.assertEqual(list(a.tokens), reference_greedy(self.model, short, 40))
        self.assertEqual(list(b.tokens), reference_greedy(self.model, long_prompt, 10))
        # 100 prompt tokens in chunks of 8 take 13 iterations, each with a decode step for "a".
        self.assertGreaterEqual(order.index("b"), 10)

    @defer.inlineCallbacks
    def test_eos_is_last_token(self) -> Any:
        """When the model emits an EOS id, that id is the last token and the stop is EOS."""
        prompt = prompts(1, seed=4)[0]
        expected = reference_greedy(self.model, prompt, 20)
        eos = expected[5]
        engine = self.make_engine(eos_ids=[eos])
        result = yield self.run_one(prompt, 20, engine=engine)[0]
        self.assertEqual(list(result.tokens), expected[: expected.index(eos) + 1])
        self.assertEqual(result.stop, EngineStop.EOS)

    def test_eos_ids_from_configs(self) -> None:
        """EOS ids come from both the generation config and the config."""
        m = tiny_llama(layers=1)
        m.generation_config.eos_token_id = [2, 7]
        self.assertEqual(eos_ids_of(m), frozenset({2, 7}))


class SeededSamplingTests(EngineTestCase):
    """Seeded sampling is a pure function of (seed, absolute position)."""

    @defer.inlineCallbacks
    def test_alone_batched_and_continued(self) -> Any:
        """Seeded sampling gives identical tokens alone, batched with others, and when cut after
        k tokens and continued from context + k tokens."""
        prompt = prompts(1, seed=5, low=20, high=21)[0]
        alone = yield self.run_one(prompt, 40, SAMPLED)[0]
        self.assertEqual(len(alone.tokens), 40)
        greedy = yield self.run_one(prompt, 40)[0]
        self.assertNotEqual(alone.tokens, greedy.tokens, "sampling should differ from greedy")
        others = [
            self.run_one(p, 30, GenParams(temperature=1.0, top_p=1.0, seed=i))[0]
            for i, p in enumerate(prompts(3, seed=6))
        ]
        batched, *_ = yield defer.gatherResults([self.run_one(prompt, 40, SAMPLED)[0], *others])
        self.assertEqual(batched.tokens, alone.tokens)
        for k in (1, 13, 39):
            rest = yield self.run_one(prompt + list(alone.tokens[:k]), 40 - k, SAMPLED)[0]
            self.assertEqual(list(rest.tokens), list(alone.tokens[k:]), k)

    @defer.inlineCallbacks
    def test_seed_changes_the_draws(self) -> Any:
        """A different seed gives a different sample (the seed reaches the sampler)."""
        prompt = prompts(1, seed=7)[0]
        a = yield self.run_one(prompt, 30, SAMPLED)[0]
        other = GenParams(SAMPLED.temperature, SAMPLED.top_p, SAMPLED.min_p, SAMPLED.top_k, 78)
        b = yield self.run_one(prompt, 30, other)[0]
        self.assertNotEqual(a.tokens, b.tokens)


class LimitTests(EngineTestCase):
    """Refusals, LENGTH at the window, expiry, cancel."""

    model_kwargs = {"eos": None, "window": 4096}
    engine_kwargs = {"max_lanes": 4, "context_window": 64}

    @defer.inlineCallbacks
    def test_overlong_prompt_is_refused(self) -> Any:
        """A prompt longer than the window fails with StreamTooLong (both numbers), no token."""
        d, rec = self.run_one(list(range(3, 3 + 65)), 10)
        error = yield self.assertFailure(d, StreamTooLong)
        self.assertEqual((error.length, error.max), (65, 64))
        self.assertEqual(rec.batches, [])

    @defer.inlineCallbacks
    def test_empty_context_is_refused(self) -> Any:
        """An empty context is a client refusal (there is nothing to extend)."""
        yield self.assertFailure(self.run_one([], 10)[0], EngineRefusal)

    @defer.inlineCallbacks
    def test_length_at_window(self) -> Any:
        """Generation stops with LENGTH when the context reaches the window."""
        result = yield self.run_one(list(range(3, 63)), 100)[0]
        self.assertEqual(len(result.tokens), 4)
        self.assertEqual(result.stop, EngineStop.LENGTH)
        full = yield self.run_one(list(range(3, 67)), 100)[0]
        self.assertEqual((full.tokens, full.stop), ((), EngineStop.LENGTH))

    @defer.inlineCallbacks
    def test_length_at_max_new(self) -> Any:
        """Generation stops with LENGTH after max_new tokens; max_new 0 gives no token."""
        result = yield self.run_one([5, 6, 7], 9)[0]
        self.assertEqual((len(result.tokens), result.stop), (9, EngineStop.LENGTH))
        none = yield self.run_one([5, 6, 7], 0)[0]
        self.assertEqual((none.tokens, none.stop), ((), EngineStop.LENGTH))

    @defer.inlineCallbacks
    def test_expiry(self) -> Any:
        """A wall budget that runs out ends the generation with EXPIRED."""
        engine = self.make_engine(max_lanes=2)
        result = yield self.run_one([5, 6, 7], 10**6, engine=engine, max_wall_ms=30)[0]
        self.assertEqual(result.stop, EngineStop.EXPIRED)
        self.assertLess(len(result.tokens), 4000)

    @defer.inlineCallbacks
    def test_cancel_mid_stream(self) -> Any:
        """cancel() ends the generation CANCELLED with exactly the delivered tokens, with no
        on_tokens call after cancel, and the other lanes keep going."""
        engine = self.make_engine(max_lanes=2)
        rec = Recorder(cancel_after=3)
        d, _ = self.run_one([5, 6, 7], 10**6, engine=engine, recorder=rec)
        other = self.run_one([9, 10], 50, engine=engine)[0]
        result = yield d
        self.assertEqual(result.stop, EngineStop.CANCELLED)
        self.assertEqual(list(result.tokens), rec.tokens)
        # The joiner was submitted at the third token; the step already in flight then gave
        # the running lane a fourth (the next step is sent off before tokens are handed over).
        self.assertIn(rec.count, (3, 4))
        self.assertEqual(rec.calls_after_cancel, 0)
        done = yield other
        self.assertEqual((len(done.tokens), done.stop), (50, EngineStop.LENGTH))

    @defer.inlineCallbacks
    def test_cancel_while_queued(self) -> Any:
        """A generation cancelled while it waits for a lane ends CANCELLED without tokens."""
        engine = self.make_engine(max_lanes=1)
        first, _ = self.run_one([5, 6, 7], 30, engine=engine)
        second, rec = self.run_one([8, 9], 30, engine=engine)
        rec.generation.cancel()
        result = yield second
        self.assertEqual((result.tokens, result.stop), ((), EngineStop.CANCELLED))
        self.assertEqual(rec.batches, [])
        yield first

    @defer.inlineCallbacks
    def test_stop_cancels_everything(self) -> Any:
        """stop() ends running and queued generations CANCELLED and later submits fail."""
        engine = self.make_engine(max_lanes=1)
        running, _ = self.run_one([5, 6, 7], 10**6, engine=engine)
        queued, _ = self.run_one([8, 9], 10**6, engine=engine)
        yield engine.stop()
        for d in (running, queued):
            result = yield d
            self.assertEqual(result.stop, EngineStop.CANCELLED)
        yield self.assertFailure(self.run_one([1, 2], 3, engine=engine)[0], RuntimeError)


class AccountingTests(EngineTestCase):
    """Statistics: KV blocks, lanes, queue depth and the cumulative counters."""

    model_kwargs = {"eos": None}

    @defer.inlineCallbacks
    def test_kv_blocks_rise_and_fall(self) -> Any:
        """kv_blocks_used follows ceil(tokens/16) per live lane while running and returns to 0."""
        engine = self.make_engine(max_lanes=2)
        rec = Recorder()
        rec.engine = engine
        d, _ = self.run_one(list(range(3, 40)), 30, engine=engine, recorder=rec)
        yield d
        # Samples are taken on the reactor, a step or more behind the worker: bounds, not values.
        used = [s.kv_blocks_used for s in rec.samples]
        self.assertGreaterEqual(max(used), math.ceil(38 / 16))
        self.assertLessEqual(max(used), math.ceil(67 / 16))
        self.assertEqual(max(s.lanes_active for s in rec.samples), 1)
        after = engine.statistics()
        self.assertEqual((after.kv_blocks_used, after.lanes_active, after.queue_depth), (0, 0, 0))
        self.assertEqual(after.kv_blocks_total, math.ceil(256 / 16) * 2)
        self.assertEqual(after.decoded_tokens, 30)
        self.assertEqual(after.prefilled_tokens, 37)

    @defer.inlineCallbacks
    def test_request_waits_for_kv_blocks(self) -> Any:
        """A request whose blocks do not fit waits in the queue until a lane frees them."""
        engine = self.make_engine(max_lanes=4, kv_blocks=6)
        first_rec = Recorder()
        first_rec.engine = engine
        first, _ = self.run_one(list(range(3, 40)), 40, engine=engine, recorder=first_rec)
        second, _ = self.run_one(list(range(3, 30)), 40, engine=engine)
        first_result = yield first
        # The second needs 5 blocks while the first holds 5 of 6: it waited the whole time.
        self.assertTrue(any(s.queue_depth == 1 for s in first_rec.samples))
        self.assertTrue(all(s.lanes_active <= 1 for s in first_rec.samples))
        self.assertTrue(all(s.kv_blocks_used <= 6 for s in first_rec.samples))
        self.assertEqual(len(first_result.tokens), 40)
        second_result = yield second
        self.assertEqual(len(second_result.tokens), 40)


class FailureTests(EngineTestCase):
    """An error inside the worker fails one generation only."""

    @defer.inlineCallbacks
    def test_an_id_outside_the_vocabulary_is_refused(self) -> Any:
        """A context with an id the model does not have is refused before it runs; a generation
        running beside it and the next one both complete."""
        good_prompt = prompts(1, seed=8)[0]
        expected = reference_greedy(self.model, good_prompt, 20)
        good, _ = self.run_one(good_prompt, 20)
        bad, rec = self.run_one([5, TINY_VOCAB + 1000, 6], 20)
        error = yield self.assertFailure(bad, EngineRefusal)
        self.assertIn(str(TINY_VOCAB + 1000), str(error))
        self.assertEqual(rec.batches, [])
        self.assertEqual(list((yield good).tokens), expected)
        after = yield self.run_one(good_prompt, 20)[0]
        self.assertEqual(list(after.tokens), expected)

    @defer.inlineCallbacks
    def test_a_failed_step_fails_its_generations_and_the_engine_serves_on(self) -> Any:
        """A step that raises on the worker thread fails the generations it carried (the
        running lane and the joining one), and the engine serves the next request from a clean
        state."""
        engine = self.make_engine(max_lanes=2)
        runner = engine.runner
        original = runner.run

        def broken(plan: Any) -> Any:
            if any(chunk.tokens[0] == 9 for chunk in plan.chunks):
                raise RuntimeError("step failed")
            return original(plan)

        runner.run = broken  # type: ignore[method-assign]
        joining: list[Any] = []

        class JoinAfterThree(Recorder):
            def __call__(self, tokens: Sequence[int]) -> None:
                super().__call__(tokens)
                if self.count >= 3 and not joining:
                    joining.append(engine.submit(GenerationRequest([9, 10], GenParams(), 10), list))

        rec = JoinAfterThree()
        running, _ = self.run_one([5, 6, 7], 10**6, engine=engine, recorder=rec)
        yield self.assertFailure(running, RuntimeError)
        # The joiner was submitted at the third token; the step already in flight then gave
        # the running lane a fourth (the next step is sent off before tokens are handed over).
        self.assertIn(rec.count, (3, 4))
        yield self.assertFailure(joining[0].result, RuntimeError)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        result = yield self.run_one([5, 6, 7], 10, engine=engine)[0]
        self.assertEqual(list(result.tokens), reference_greedy(self.model, [5, 6, 7], 10))
        self.assertEqual(engine.statistics().kv_blocks_used, 0)

    @defer.inlineCallbacks
    def test_on_tokens_error_cancels_only_that_generation(self) -> Any:
        """An on_tokens callback that raises cancels its own generation, not the engine."""

        def explode(_tokens: Sequence[int]) -> None:
            raise ValueError("boom")

        request = GenerationRequest([5, 6, 7], GenParams(), 50)
        result = yield self.engine.submit(request, explode).result
        self.assertEqual(result.stop, EngineStop.CANCELLED)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 1)
        ok = yield self.run_one([5, 6, 7], 5)[0]
        self.assertEqual(len(ok.tokens), 5)


class KeptStageTests(EngineTestCase):
    """Stages that keep their KV (docs/protocol.md section 12.8): rows equal, bit for bit,
    whether a request runs alone or batched with others, and generate a full node's tokens."""

    model_kwargs = {"layers": 4}

    def kept(self, owner: str, session: int, position: int, *args: Any) -> Any:
        stages = self.engine.kept_stages
        assert stages is not None
        return stages.forward(owner, session, position, StageForward(*args))

    @defer.inlineCallbacks
    def alone_then_recorded(self, seed: int) -> Any:
        """Three contexts, each one's rows sent alone through [0, 2) (then released), the
        engine's stage driver, and the size of each batch its worker computes from then on."""
        contexts = prompts(3, seed=seed, low=9, high=15)
        alone = []
        for i, tokens in enumerate(contexts):
            alone.append((yield self.kept("a", i, 0, tuple(tokens), 0, 2, None)).hidden)
        driver = self.engine.kept_stages
        assert driver is not None
        driver.release("a")
        return contexts, alone, driver, self.record_batches(driver)

    def record_batches(self, driver: Any) -> list[int]:
        """The size of each batch ``driver``'s worker computes from now on."""
        sizes: list[int] = []
        forward = driver._stages.forward

        def recording(batch: Any) -> Any:
            sizes.append(len(batch))
            return forward(batch)

        self.patch(driver._stages, "forward", recording)
        return sizes

    @defer.inlineCallbacks
    def generate(self, prompt: list[int], count: int, chunk: int) -> Any:
        """``count`` greedy tokens through stages [0, 1) and [1, 4) of this engine, the prompt
        in chunks of ``chunk``; each step's hidden rows are returned too."""
        context, out, rows = list(prompt), [], []
        position = 0
        while len(out) < count:
            piece = tuple(context[position : position + chunk])
            first = yield self.kept("head", 1, position, piece, 0, 1, None)
            last = yield self.kept("tail", 2, position, (), 1, 4, first.hidden)
            rows.append(first.hidden)
            position += len(piece)
            if position == len(context):
                context.append(last.token)
                out.append(last.token)
        return out, rows

    @defer.inlineCallbacks
    def through(self, prompt: Sequence[int], session: int) -> Any:
        """``prompt`` in one request through stages [0, 1) and [1, 4) of a new ``session``
        (released after): the first stage's hidden rows and the last stage's token."""
        first = yield self.kept("head", session, 0, tuple(prompt), 0, 1, None)
        last = yield self.kept("tail", session, 0, (), 1, 4, first.hidden)
        driver = self.engine.kept_stages
        assert driver is not None
        driver.release("head", session)
        driver.release("tail", session)
        return first.hidden, last.token

    def stage_pools(self) -> Any:
        """The engine's stages' prefix pools, by layer range."""
        driver = self.engine.kept_stages
        assert driver is not None
        return driver._stages.prefixes

    @defer.inlineCallbacks
    def test_a_shared_prefix_is_taken_from_the_pool_bit_for_bit(self) -> Any:
        """A session whose prompt starts with another's first 32 positions takes those two
        blocks from each stage's prefix pool, and answers the same hidden rows and token, bit
        for bit, as when it computed every row."""
        shared = prompts(1, seed=31, low=32, high=33)[0]
        first = shared + prompts(1, seed=32, low=9, high=10)[0]
        second = shared + prompts(1, seed=33, low=11, high=12)[0]
        cold = yield self.through(second, 1)
        self.stage_pools().clear()
        yield self.through(first, 2)
        self.assertEqual([p.reused_rows for p in self.stage_pools().values()], [0, 0])
        warm = yield self.through(second, 3)
        self.assertEqual([p.reused_rows for p in self.stage_pools().values()], [32, 32])
        self.assertEqual(warm, cold)

    @defer.inlineCallbacks
    def test_blocks_completed_one_row_at_a_time_are_kept(self) -> Any:
        """A generation's blocks filled by its tokens, one row per request, are kept too: a
        prompt that starts with its first 32 positions reuses them and gets the engine's own
        greedy token."""
        prompt = prompts(1, seed=34, low=10, high=11)[0]
        generated, _ = yield self.generate(prompt, 23, 256)
        follow = [*prompt, *generated][:32] + prompts(1, seed=35, low=5, high=6)[0]
        _, token = yield self.through(follow, 3)
        self.assertEqual([p.reused_rows for p in self.stage_pools().values()], [32, 32])
        expected = yield self.run_one(follow, 1)[0]
        self.assertEqual([token], list(expected.tokens))

    @defer.inlineCallbacks
    def test_kept_stages_generate_the_engines_tokens(self) -> Any:
        """A prompt in chunks of 7, then one row per token, through two kept stages gives
        exactly the tokens the engine's own greedy generation gives."""
        prompt = prompts(1, seed=21, low=30, high=31)[0]
        tokens, _ = yield self.generate(prompt, 20, 7)
        d, _ = self.run_one(prompt, 20)
        result = yield d
        self.assertEqual(tokens, list(result.tokens))

    @defer.inlineCallbacks
    def test_a_batch_computes_what_each_request_alone_does(self) -> Any:
        """Three sessions' rows sent at once (one batch on the worker) are bit-identical to
        the same rows sent one at a time, and a bad request in the batch fails alone."""
        contexts, alone, _, sizes = yield self.alone_then_recorded(22)
        together = [
            self.kept("b", i, 0, tuple(tokens), 0, 2, None) for i, tokens in enumerate(contexts)
        ]
        bad = self.kept("b", 9, 0, (TINY_VOCAB + 5,), 0, 2, None)
        answers = yield defer.gatherResults(together)
        self.assertEqual([a.hidden for a in answers], alone)
        yield self.assertFailure(bad, StageForwardError)
        self.assertEqual(sum(sizes), 4)
        self.assertGreater(max(sizes), 1)

    @defer.inlineCallbacks
    def test_forward_all_runs_every_request_in_one_pass(self) -> Any:
        """``forward_all`` (a STAGE_BATCH_REQ's rows) hands the worker every request at once:
        one pass of all four, the three good ones bit-identical to each sent alone, the bad one
        failing alone."""
        contexts, alone, driver, sizes = yield self.alone_then_recorded(23)
        requests = [(i, 0, StageForward(tuple(t), 0, 2, None)) for i, t in enumerate(contexts)]
        requests.append((9, 0, StageForward((TINY_VOCAB + 5,), 0, 2, None)))
        *answers, bad = yield driver.forward_all("b", requests)
        self.assertEqual([a.hidden for a in answers], alone)
        self.assertIsInstance(bad, StageForwardError)
        self.assertEqual(sizes, [4])

    @defer.inlineCallbacks
    def test_a_session_holds_only_what_it_was_sent(self) -> Any:
        """Position past the kept rows, another layer range, or no free slot: refused, and the
        refused session is gone; a released owner's slots are free again."""
        tokens = (5, 6, 7)
        yield self.kept("o", 1, 0, tokens, 0, 2, None)
        yield self.assertFailure(self.kept("o", 1, 4, (8,), 0, 2, None), StageForwardError)
        yield self.assertFailure(self.kept("o", 1, 3, (8,), 0, 2, None), StageForwardError)
        for session in range(4):
            yield self.kept("o", session, 0, tokens, 0, 2, None)
        yield self.assertFailure(self.kept("p", 1, 0, tokens, 0, 2, None), StageForwardError)
        yield self.assertFailure(self.kept("o", 0, 3, (8,), 0, 3, None), StageForwardError)
        assert self.engine.kept_stages is not None
        self.engine.kept_stages.release("o")
        yield self.kept("p", 1, 0, tokens, 0, 2, None)


class StageForwardTests(EngineTestCase):
    """Pipeline stages: split forwards equal one full forward (bit-exact in float32)."""

    model_kwargs = {"layers": 4}

    def full_forward_token(self, tokens: list[int]) -> int:
        with torch.inference_mode():
            logits = self.model(torch.tensor([tokens])).logits[0, -1]
        return int(torch.argmax(logits).item())

    @defer.inlineCallbacks
    def run_stages(self, tokens: list[int], bounds: list[int]) -> Any:
        hidden: bytes | None = None
        result = None
        for start, end in itertools.pairwise(bounds):
            result = yield self.engine.stage_forward(
                tokens if hidden is None else [], start, end, hidden
            )
            if end < bounds[-1]:
                self.assertIsNone(result.token)
                self.assertIsNotNone(result.hidden)
                hidden = result.hidden
        return result

    @defer.inlineCallbacks
    def test_two_and_three_stages_equal_full_forward(self) -> Any:
        """Splitting at any boundaries gives the full forward's greedy token, and the hidden
        state between stages is bit-identical whatever the split."""
        for tokens in prompts(3, seed=9, low=5, high=40):
            expected = self.full_forward_token(tokens)
            answers = {}
            for bounds in ([0, 4], [0, 2, 4], [0, 1, 4], [0, 1, 3, 4], [0, 0, 2, 4]):
                result = yield self.run_stages(tokens, bounds)
                self.assertIsNone(result.hidden)
                answers[str(bounds)] = result.token
            # Every split is compared at once, so that a failure shows which splits part.
            self.assertEqual(set(answers.values()), {expected}, (expected, answers, tokens))
            a = yield self.run_stages(tokens, [0, 1, 3])
            b = yield self.run_stages(tokens, [0, 2, 3])
            self.assertEqual(a.hidden, b.hidden)
            dtype, shape, raw = msgpack.unpackb(a.hidden)
            self.assertEqual(
                (dtype, shape, len(raw)), ("f32", [len(tokens), 64], len(tokens) * 256)
            )

    @defer.inlineCallbacks
    def test_half_precision_blob_is_accepted(self) -> Any:
        """A later stage accepts an f16 or bf16 hidden blob (converted to the model dtype)."""
        tokens = prompts(1, seed=10)[0]
        mid = yield self.run_stages(tokens, [0, 2])
        h = decode_hidden(mid.hidden, 64)
        for dt in (torch.float16, torch.bfloat16):
            result = yield self.engine.stage_forward([], 2, 4, encode_hidden(h.to(dt)))
            self.assertIsInstance(result.token, int)

    @defer.inlineCallbacks
    def test_bad_requests_fail(self) -> Any:
        """Bad bounds, a malformed blob, a wrong hidden size or a missing input are
        StageForwardError."""
        good = encode_hidden(torch.zeros(3, 64))
        cases: list[tuple[list[int], int, int, bytes | None]] = [
            ([1, 2], 3, 2, None),
            ([1, 2], 0, 5, None),
            ([1, 2], -1, 2, None),
            ([], 0, 2, None),
            ([1, 2], 1, 2, None),
            ([], 1, 2, b"\xc1garbage"),
            ([], 1, 2, msgpack.packb(["f64", [3, 64], b"\0" * 3 * 64 * 8])),
            ([], 1, 2, encode_hidden(torch.zeros(3, 32))),
            ([], 1, 2, good[:-4]),
            ([], 1, 2, msgpack.packb(["f32", [3], b""])),
            ([1, TINY_VOCAB + 5], 0, 2, None),
        ]
        for tokens, start, end, blob in cases:
            yield self.assertFailure(
                self.engine.stage_forward(tokens, start, end, blob), StageForwardError
            )
        ok = yield self.engine.stage_forward([], 1, 2, good)
        self.assertIsNotNone(ok.hidden)


class LongPromptTests(EngineTestCase):
    """Prompts around and beyond a chunk, on a model whose norms are not 1.0 and whose
    projections have biases (so a skipped norm weight, bias or a wrong position shows)."""

    engine_kwargs = {"max_lanes": 3, "prefill_chunk": 128}

    def setUp(self) -> None:
        self.model = random_norms_model()
        self.engine = self.make_engine(**self.engine_kwargs)

    @defer.inlineCallbacks
    def test_prompts_around_the_chunk_size_equal_generate(self) -> Any:
        """Prompts of 1, 127, 128, 129, 300 and window - 12 tokens, one at a time, give
        generate()'s greedy tokens."""
        window = self.model.config.max_position_embeddings
        rng = random.Random(21)
        for n in (1, 127, 128, 129, 300, window - 12):
            prompt = [rng.randrange(3, TINY_VOCAB) for _ in range(n)]
            result = yield self.run_one(prompt, 10)[0]
            expected = reference_greedy(self.model, prompt, 10)
            self.assertEqual(list(result.tokens), expected, n)

    @defer.inlineCallbacks
    def test_long_prompts_joining_running_lanes_equal_generate(self) -> Any:
        """Long prompts computed in chunks beside lanes that are decoding give the same tokens
        as alone, and the running lanes' tokens are unchanged."""
        rng = random.Random(22)
        short = [rng.randrange(3, TINY_VOCAB) for _ in range(5)]
        longs = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (129, 300)]
        plans = spy_on_plans(self.engine)
        running = self.run_one(short, 60)[0]
        joining = [self.run_one(p, 10)[0] for p in longs]
        results = yield defer.gatherResults([running, *joining])
        for prompt, result, n in zip([short, *longs], results, (60, 10, 10), strict=True):
            self.assertEqual(list(result.tokens), reference_greedy(self.model, prompt, n))
        self.assertTrue(any(plan.decode and plan.chunks for plan in plans))


def native_library_dir() -> Path:
    """Where the tests' engines keep the native kernels (they are built once there)."""
    from sfnode.engines.weights.loading import default_cache_dir

    return default_cache_dir().parent / "kernels"


class WeightsModeTests(EngineTestCase):
    """bfloat16, int8 and int4 (docs/engine.md section 5): a lane's tokens do not depend on the
    lanes beside it, greedy and seeded (bit for bit: float32 products of different row counts
    round differently, the bfloat16, int8 and int4 ones do not)."""

    @defer.inlineCallbacks
    def test_each_mode_is_the_same_alone_and_batched(self) -> Any:
        """In every weights mode and with each kernel family (docs/engine.md section 5.1),
        fused step or not (section 5.2), concurrent generations (greedy and seeded, some with
        prompts longer than a chunk, reusing the solo runs' cached blocks) equal their solo
        runs."""
        from sfnode.engines.kernels import native

        ps = prompts(5, seed=31, low=3, high=150)
        params = [GenParams() if i % 2 == 0 else SAMPLED for i in range(5)]
        cases: list[tuple[str, str, bool]] = [
            ("bfloat16", "auto", True),
            ("int8", "torch", True),
            ("int4", "torch", True),
        ]
        if not isinstance(native.load(native_library_dir()), str):
            cases += [("int8", "native", True), ("int4", "native", True)]
            cases += [("int4", "native", False)]
        for mode, kernels, fused in cases:
            # The batched runs reuse the solo runs' prompts from the prefix cache too.
            engine = self.make_engine(
                max_lanes=3,
                weights=mode,
                prefill_chunk=64,
                kernels=kernels,
                fused_step=fused,
            )
            self.assertEqual(engine.weights.mode, mode)
            self.assertEqual(engine.fused_step, kernels == "native" and fused)
            solo = []
            for p, gp in zip(ps, params, strict=True):
                solo.append((yield self.run_one(p, 20, gp, engine=engine)[0]))
            runs = [
                self.run_one(p, 20, gp, engine=engine)[0] for p, gp in zip(ps, params, strict=True)
            ]
            batched = yield defer.gatherResults(runs)
            self.assertEqual(batched, solo, (mode, kernels, fused))

    @defer.inlineCallbacks
    def test_the_model_as_stored_gives_the_model_objects_tokens(self) -> Any:
        """An engine built by from_loaded on the model's folder (as the node builds it: the
        weights as stored, no transformers model object) gives the tokens of one built on the
        transformers model itself."""
        from pathlib import Path

        from sfnode.engines.weights.loading import load_model
        from tests.tinymodel import save_tiny_model

        keeping = self.make_engine(max_lanes=2, weights="int4", dense_copies=False)
        folder = save_tiny_model(Path(self.mktemp()) / "tiny")
        loaded = load_model(folder)
        self.assertFalse(hasattr(loaded, "model"))
        stored = TransformersEngine.from_loaded(
            loaded,
            reactor,
            EngineConfig(max_lanes=2, weights="int4", dense_copies=False, interactive_lanes=0),
        )
        stored.start()
        self.addCleanup(stored.stop)
        for prompt in prompts(3, seed=33):
            a = yield self.run_one(prompt, 12, engine=keeping)[0]
            b = yield self.run_one(prompt, 12, engine=stored)[0]
            self.assertEqual(a, b)

    def test_modes_the_runner_cannot_serve_are_refused(self) -> None:
        """--weights int4 on the model's own forward is refused with the reason."""
        from sfnode.engines.weights.gather import WeightsError

        with self.assertRaises(WeightsError) as caught:
            TransformersEngine(self.model, reactor, EngineConfig(weights="int4", lean_step=False))
        self.assertIn("--stock-kernels", str(caught.exception))


class PrefixReuseTests(EngineTestCase):
    """The prefix cache through the engine (docs/engine.md section 4)."""

    @defer.inlineCallbacks
    def test_reuse_gives_the_tokens_of_a_cold_run(self) -> Any:
        """Prompts sharing a 96-token prefix give the same greedy and seeded tokens with the
        prefix cache as without it, and the cache was used."""
        rng = random.Random(41)
        shared = [rng.randrange(3, TINY_VOCAB) for _ in range(96)]
        tails = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (1, 7, 20, 33)]
        params = [GenParams(), SAMPLED, GenParams(), SAMPLED]
        cold = self.make_engine(max_lanes=2, prefix_cache=False)
        warm = self.make_engine(max_lanes=2, prefill_chunk=32)
        for engine in (cold, warm):
            engine.results = []  # type: ignore[attr-defined]
            for tail, gp in zip(tails, params, strict=True):
                result = yield self.run_one(shared + tail, 16, gp, engine=engine)[0]
                engine.results.append(result)  # type: ignore[attr-defined]
        self.assertEqual(warm.results, cold.results)  # type: ignore[attr-defined]
        self.assertIsNone(cold.statistics().prefix)
        stats = warm.statistics().prefix
        assert stats is not None
        self.assertEqual(stats.hits, 3)
        self.assertEqual(stats.reused_tokens, 3 * 96)
        self.assertEqual(warm.statistics().prefilled_tokens, 96 + 1 + 7 + 20 + 33)

    @defer.inlineCallbacks
    def test_a_prefix_shared_inside_a_block_gives_the_tokens_of_a_cold_run(self) -> Any:
        """A prompt that shares 40 tokens with an earlier one (two blocks and half of a third)
        takes those positions from the pool and gives the tokens of a cold run."""
        rng = random.Random(43)
        shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]
        first = shared + [rng.randrange(3, TINY_VOCAB) for _ in range(30)]
        second = shared + [rng.randrange(3, TINY_VOCAB) for _ in range(9)]
        cold = self.make_engine(max_lanes=2, prefix_cache=False)
        warm = self.make_engine(max_lanes=2)
        yield self.run_one(first, 4, engine=warm)[0]
        for params in (GenParams(), SAMPLED):
            a = yield self.run_one(second, 16, params, engine=cold)[0]
            b = yield self.run_one(second, 16, params, engine=warm)[0]
            self.assertEqual(a, b)
        stats = warm.statistics().prefix
        assert stats is not None
        self.assertGreaterEqual(stats.reused_tokens, 40)

    @defer.inlineCallbacks
    def test_a_small_pool_evicts_and_stays_exact(self) -> Any:
        """With a pool of 4 blocks, prompts that evict each other's blocks still give their
        cold tokens, and the pool's accounting is back to no lane when idle."""
        rng = random.Random(42)
        bases = [[rng.randrange(3, TINY_VOCAB) for _ in range(48)] for _ in range(3)]
        cold = self.make_engine(max_lanes=2, prefix_cache=False)
        small = self.make_engine(max_lanes=2, prefix_cache_blocks=4)
        for round_ in range(2):
            for base in bases:
                prompt = [*base, 5 + round_]
                a = yield self.run_one(prompt, 12, engine=cold)[0]
                b = yield self.run_one(prompt, 12, engine=small)[0]
                self.assertEqual(a, b)
        stats = small.statistics().prefix
        assert stats is not None
        self.assertGreater(stats.evictions, 0)
        self.assertLessEqual(stats.cached_blocks, 4)
        self.assertEqual(small.statistics().kv_blocks_used, 0)


class RecordingPace:
    """Stands in for the engine's rate estimator: fixed rates, and a record of every step."""

    def __init__(self, rates: StepRates) -> None:
        self.rates = rates
        self.observed: list[tuple[StepCost, float]] = []

    def observe(self, cost: StepCost, seconds: float) -> StepRates:
        self.observed.append((cost, seconds))
        return self.rates


class StepTimeTests(EngineTestCase):
    """Steps sized in time (docs/engine.md section 3) through the engine."""

    @defer.inlineCallbacks
    def test_steps_are_timed_and_planned_with_the_rates(self) -> Any:
        """The engine hands every step's cost and duration to its estimator and plans with its
        rates: at a slow machine's rates (50 ms a step, 2 ms a prompt token) and a 250 ms
        budget, a 240-token batch prompt beside a free lane goes in chunks of 96; with
        --step-ms 0 in chunks of the prefill chunk (128)."""
        slow = StepRates(step_s=0.05, decode_row_s=0.005, prompt_row_s=0.002, keys_s=0.0)
        prompt = prompts(1, seed=61, low=240, high=241)[0]
        for step_ms, want in ((250, [96, 96, 48]), (0, [128, 112])):
            engine = self.make_engine(
                interactive_lanes=1, step_ms=step_ms, max_lanes=2, prefill_chunk=128
            )
            pace = RecordingPace(slow)
            engine.pace = pace  # type: ignore[assignment]
            plans = spy_on_plans(engine)
            yield self.run_one(prompt, 3, engine=engine)[0]
            chunks = [len(chunk.tokens) for plan in plans for chunk in plan.chunks]
            self.assertEqual(chunks, want, step_ms)
            self.assertEqual([cost for cost, _ in pace.observed], [StepCost.of(p) for p in plans])
            self.assertTrue(all(seconds >= 0 for _, seconds in pace.observed))

    @defer.inlineCallbacks
    def test_the_engine_learns_its_rates(self) -> Any:
        """After a few generations the engine's rates are its own measurements, not the
        prior."""
        engine = self.make_engine(max_lanes=2)
        self.assertEqual(engine.pace.rates, PRIOR)
        for prompt in prompts(3, seed=62, low=20, high=80):
            yield self.run_one(prompt, 8, engine=engine)[0]
        self.assertNotEqual(engine.pace.rates, PRIOR)


class LogprobTests(EngineTestCase):
    """Token logprobs (docs/protocol.md section 12.1) from the distribution the sampler used."""

    @defer.inlineCallbacks
    def test_greedy_logprobs_are_the_models_log_softmax(self) -> Any:
        """Under greedy, each token's logprob is log_softmax of the model's own logits at that
        position, it equals the first of the alternatives, and the alternatives are the model's
        best tokens in order."""
        prompt = prompts(1, seed=51)[0]
        got: list[Any] = []

        def sink(batch: TokenBatch) -> None:
            self.assertIsNotNone(batch.logprobs)
            self.assertEqual(len(batch.logprobs or ()), len(batch.tokens))
            got.extend(zip(batch.tokens, batch.logprobs or (), strict=True))

        self.assertTrue(self.engine.supports_logprobs)
        request = GenerationRequest(prompt, GenParams(logprobs=4), 8)
        yield self.engine.submit(request, sink).result
        context = list(prompt)
        for token, logprob in got:
            with torch.inference_mode():
                logits = self.model(torch.tensor([context])).logits[0, -1].float()
            expected = torch.log_softmax(logits, -1)
            best = torch.topk(expected, 3)
            self.assertAlmostEqual(logprob.logprob, float(expected[token]), places=4)
            self.assertEqual([i for i, _ in logprob.top], best.indices.tolist())
            self.assertEqual(logprob.top[0][1], logprob.logprob)
            context.append(token)

    @defer.inlineCallbacks
    def test_sampled_logprobs_cover_the_kept_candidates(self) -> Any:
        """Under sampling, logprobs are those of the kept candidates renormalised: the chosen
        token is one of them, values are at most 0, and a generation that asks for none gets
        batches without them."""
        params = GenParams(temperature=0.9, top_k=5, seed=3, logprobs=21)
        calls: list[tuple[int, Any]] = []

        def sink(batch: TokenBatch) -> None:
            calls.append((len(batch), batch.logprobs))
            for token, logprob in zip(batch.tokens, batch.logprobs or (), strict=True):
                ids = [i for i, _ in logprob.top]
                self.assertLessEqual(len(ids), 5)
                self.assertIn(token, ids)
                total = sum(math.exp(v) for _, v in logprob.top)
                self.assertAlmostEqual(total, 1.0, places=4)
                self.assertTrue(all(v <= 0.0 for _, v in logprob.top))

        yield self.engine.submit(GenerationRequest([5, 6, 7], params, 10), sink).result
        self.assertEqual(sum(n for n, _ in calls), 10)
        self.assertNotIn(None, [logprobs for _, logprobs in calls])
        plain: list[TokenBatch] = []
        yield self.engine.submit(GenerationRequest([5, 6, 7], GenParams(), 3), plain.append).result
        self.assertEqual(sum(len(batch) for batch in plain), 3)
        self.assertEqual({batch.logprobs for batch in plain}, {None})


def echo_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts that quote themselves: a random passage, other tokens, then the passage's
    start again (so prompt lookup drafts from the first token on)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(20, 40))]
        filler = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(3, 10))]
        out.append(passage + filler + passage[: rng.randrange(3, 8)])
    return out


def draft_from_answers(
    engine: TransformersEngine, answers: dict[tuple[int, ...], list[int]]
) -> None:
    """Make the engine's scheduler draft, for a prompt in ``answers``, the tokens decoding
    without drafts gave, with one in three drafts wrong from its third token on (so the runner
    verifies drafts accepted whole, in part and not at all); other prompts draft by lookup.

    The random tiny model seldom repeats its context, so without this its drafts would all be
    refused and the accepting path never run."""
    scheduler = engine.scheduler
    lookup = scheduler._draft

    def draft(lane: Any) -> tuple[int, ...]:
        request = lane.request
        answer = answers.get(tuple(request.context))
        if answer is None:
            return lookup(lane)
        done = len(lane.generated)
        room = min(request.max_new - done, request.token_limit - lane.tokens) - 1
        guess = [t for t in answer[done : done + min(room, 4)] if t not in request.eos_ids]
        if done % 3 == 1 and len(guess) > 2:
            guess[2:] = [(t + 1) % TINY_VOCAB or 3 for t in guess[2:]]
        return tuple(guess)

    scheduler._draft = draft  # type: ignore[method-assign]


class SpeculativeTests(EngineTestCase):
    """Speculative decoding by prompt lookup (docs/engine.md section 3.1): the tokens are those
    of decoding without drafts, whatever was drafted and whoever shares the step."""

    def same_tokens(
        self, mode: str, kernels: str = "auto", fused: bool = True
    ) -> defer.Deferred[Any]:
        return defer.ensureDeferred(self._same_tokens(mode, kernels, fused))

    async def _same_tokens(self, mode: str, kernels: str, fused: bool) -> None:
        """Greedy and seeded generations, some with logprobs, alone and eight at a time on
        three lanes, with drafts equal the same generations without; drafted tokens were
        accepted and refused."""
        ps = echo_prompts(6, seed=61) + prompts(2, seed=62)
        params = [
            GenParams(),
            SAMPLED,
            GenParams(temperature=0.4, seed=9, logprobs=3),
            GenParams(logprobs=2),
        ] * 2
        engines = [
            self.make_engine(
                max_lanes=3,
                weights=mode,
                kernels=kernels,
                fused_step=fused,
                prefix_cache=False,
                speculative=speculative,
                draft_tokens=5,
            )
            for speculative in ("off", "ngram")
        ]
        plain, drafting = engines
        self.assertIsNone(plain.speculation)
        self.assertIsNotNone(drafting.speculation)
        results: list[list[Any]] = []
        for engine in (plain, drafting):
            solo = []
            for p, gp in zip(ps, params, strict=True):
                solo.append(await self.collect(engine, p, gp))
            results.append(solo)
            if engine is plain:
                # Three in four prompts draft what plain decoding gave them (see
                # draft_from_answers); the others draft by lookup.
                answers = {
                    tuple(p): run[0]
                    for i, (p, run) in enumerate(zip(ps, solo, strict=True))
                    if i % 4 != 3
                }
                draft_from_answers(drafting, answers)
            batched = await defer.gatherResults(
                [
                    defer.ensureDeferred(self.collect(engine, p, gp))
                    for p, gp in zip(ps, params, strict=True)
                ]
            )
            results.append(batched)
        for i, other in enumerate(results[1:], 1):
            self.assertEqual(other, results[0], (mode, kernels, fused, i))
        counts = drafting.statistics().steps
        self.assertGreater(counts.accepted, 0)
        self.assertGreater(counts.drafted, counts.accepted)
        self.assertLess(counts.decode_rows, counts.decode_tokens)
        self.assertEqual(plain.statistics().steps.drafted, 0)

    async def collect(
        self, engine: TransformersEngine, prompt: list[int], params: GenParams
    ) -> tuple[list[int], list[Any], Any]:
        """The tokens streamed, their logprobs and the result of one generation of 40."""
        tokens: list[int] = []
        logprobs: list[Any] = []

        def sink(batch: TokenBatch) -> None:
            tokens.extend(batch.tokens)
            logprobs.extend(batch.logprobs or ())

        result = await engine.submit(GenerationRequest(prompt, params, 40), sink).result
        self.assertEqual(list(result.tokens), tokens)
        return tokens, logprobs, result.stop

    def test_float32(self) -> defer.Deferred[Any]:
        """float32: drafts change no token, greedy or seeded, alone or batched, nor a logprob
        (the verified rows are decode rows at their own positions, attended alike)."""
        return self.same_tokens("float32")

    @defer.inlineCallbacks
    def test_greedy_equals_generate(self) -> Any:
        """With drafts, greedy tokens still equal model.generate(do_sample=False)."""
        engine = self.make_engine(speculative="ngram")
        ps = echo_prompts(3, seed=63)
        expected = [reference_greedy(self.model, prompt, 30) for prompt in ps]
        draft_from_answers(engine, {tuple(ps[0]): expected[0]})
        for prompt, tokens in zip(ps, expected, strict=True):
            d, _ = self.run_one(prompt, 30, engine=engine)
            result = yield d
            self.assertEqual(list(result.tokens), tokens)
        self.assertGreater(engine.statistics().steps.accepted, 0)

    @defer.inlineCallbacks
    def test_quantized_modes(self) -> Any:
        """bfloat16, int8 and int4 (torch kernels, and the native ones with and without the
        fused step where they build): drafts change no token nor logprob."""
        from sfnode.engines.kernels import native

        yield self.same_tokens("bfloat16")
        yield self.same_tokens("int8", "torch")
        yield self.same_tokens("int4", "torch")
        if not isinstance(native.load(native_library_dir()), str):
            yield self.same_tokens("int8", "native")
            yield self.same_tokens("int4", "native", False)

    def test_the_model_forward_does_not_speculate(self) -> None:
        """The model's own forward (--stock-kernels) verifies no drafts: speculation is off,
        and a bad mode or draft length is refused."""
        engine = self.make_engine(lean_step=False, speculative="ngram")
        self.assertIsNone(engine.speculation)
        self.assertRaises(ValueError, EngineConfig, speculative="x")
        self.assertRaises(ValueError, EngineConfig, draft_tokens=0)


class KeptStageTorchTests(KeptStageTests):
    """:class:`KeptStageTests` with the layers as torch operators (no native step)."""

    engine_kwargs = {"max_lanes": 4, "fused_step": False}
