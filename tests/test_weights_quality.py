"""The bundled model in its own 4-bit weights keeps its quality (docs/engine.md section 5).

One slow test on SmolLM2-135M (the bundled GGUF, converted into the cache the first time):
perplexity on a fixed English text with ``--weights auto`` (int4 layers from the file's Q4_1
blocks, the Q8_0 head requantized to int4) within 3% of the float32 path (the same file
dequantized), and the README's question answered with Paris.  Locally ``SFNODE_SKIP_SLOW=1``
skips it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.trial import unittest

from tests.bundled import BUNDLED_MODEL_SKIP

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def perplexity(runner: Any, ids: list[int]) -> float:
    import torch

    logits = runner.sequence_logits(ids)
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()
    return float(torch.exp(nll))


class BundledWeightsTests(unittest.SynchronousTestCase):
    skip = BUNDLED_MODEL_SKIP

    def test_auto_weights_keep_perplexity_and_the_answer(self) -> None:
        """``auto`` serves int4 kernels throughout, its perplexity on tests/data/perplexity.txt is
        within 3% of float32's, and greedy decoding of the README's question says Paris."""
        from sfnode.engines.runners.decoder import DecoderRunner
        from sfnode.engines.scheduling.plan import ChunkRow, DecodeRow, StepPlan
        from sfnode.engines.weights.gather import gather_weights
        from sfnode.engines.weights.loading import load_model
        from sfnode.linkf.wire import GenParams

        loaded = load_model(threads=2)
        tokenizer = loaded.tokenizer
        ids = tokenizer(TEXT.read_text())["input_ids"]
        float32 = DecoderRunner(gather_weights(loaded.stored, "float32"), slots=1, window=1024)
        quantized_weights = gather_weights(loaded.stored, "auto", cache_file=loaded.cache_file)
        self.assertEqual(quantized_weights.describe(), "int4 x 121")
        quantized = DecoderRunner(quantized_weights, slots=1, window=1024)
        reference, served = perplexity(float32, ids), perplexity(quantized, ids)
        self.assertLess(abs(served - reference) / reference, 0.03, (served, reference))

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        greedy = GenParams()
        out = quantized.run(StepPlan(chunks=(ChunkRow(0, 0, tuple(prompt), True, greedy, 0),)))
        tokens = [out.chunks[0]]
        while len(tokens) < 16 and tokens[-1] != tokenizer.eos_token_id:
            row = DecodeRow(0, tokens[-1], len(prompt) + len(tokens) - 1, greedy, 0)
            tokens.append(quantized.run(StepPlan(decode=(row,))).decode[0])
        self.assertIn("Paris", tokenizer.decode(tokens, skip_special_tokens=True))


class BundledPrefixReuseTests(unittest.TestCase):
    """On the bundled model's float32 path, a prompt that reuses a cached system prompt gives
    the greedy tokens of a cold run (docs/engine.md section 4)."""

    skip = BundledWeightsTests.skip

    def test_reuse_gives_the_tokens_of_a_cold_run(self) -> Any:
        from twisted.internet import defer, reactor

        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.engines.weights.loading import load_model
        from sfnode.generation import GenerationRequest
        from sfnode.linkf.wire import GenParams

        loaded = load_model(threads=2)
        tokenizer = loaded.tokenizer
        system = " ".join(TEXT.read_text().split()[:120])

        def prompt(question: str) -> list[int]:
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
            return ids

        first, second = prompt("Say it in one line."), prompt("What is it about?")

        def engine(cache: bool) -> TransformersEngine:
            config = EngineConfig(
                weights="float32", prefix_cache=cache, max_lanes=1, interactive_lanes=0
            )
            built = TransformersEngine.from_loaded(loaded, reactor, config)
            built.start()
            self.addCleanup(built.stop)
            return built

        def run(on: TransformersEngine, ids: list[int]) -> defer.Deferred[Any]:
            request = GenerationRequest(ids, GenParams(), 24)
            return on.submit(request, lambda *args: None).result

        @defer.inlineCallbacks
        def check() -> Any:
            cached, cold = engine(True), engine(False)
            yield run(cached, first)
            reused = yield run(cached, second)
            stats = cached.statistics().prefix
            assert stats is not None
            self.assertGreaterEqual(stats.reused_tokens, 96)
            fresh = yield run(cold, second)
            self.assertEqual(reused.tokens, fresh.tokens)

        return check()
