"""Speculative decoding by prompt lookup on the bundled model (docs/engine.md section 3.1).

The tiny random model seldom repeats its prompt; SmolLM2 asked to repeat or fix a passage
copies it, so here drafts come from the real lookup and are mostly accepted.  In float32 the
tokens with drafts equal those without, greedy and seeded, alone and three at a time.
It loads the bundled model (converting it into the cache if no node did yet); locally
``SFNODE_SKIP_SLOW=1`` skips it.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from sfnode.generation import GenerationRequest
from sfnode.linkf.wire import GenParams
from tests.bundled import BUNDLED_MODEL_SKIP

PASSAGE = (
    "To reset the controller, hold the red button for ten seconds until the status light "
    "blinks twice. Release the button, wait for the light to turn solid green, and then "
    "connect the cable to port B."
)
ASKS = (
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
    + PASSAGE.replace(" the ", " teh "),
    "Write a short story about a lighthouse keeper.",
)


class BundledModelSpeculationTests(TestCase):
    skip = BUNDLED_MODEL_SKIP
    timeout = 900

    @defer.inlineCallbacks
    def test_drafts_change_no_token_in_float32(self) -> Any:
        """Two extract prompts and a story, greedy and seeded: with --speculative ngram the
        tokens equal those without, alone and three at a time, and most drafted tokens were
        accepted on the extract prompts."""
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.engines.weights.loading import load_model

        loaded = load_model(None, dtype="float32", threads=2)
        tokenizer = loaded.tokenizer
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
            )
            for ask in ASKS
        ]
        prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        params = [GenParams(), GenParams(temperature=0.7, top_p=0.9, seed=21), GenParams(seed=3)]
        engines = []
        for speculative in ("off", "ngram"):
            config = EngineConfig(
                weights="float32",
                max_lanes=3,
                interactive_lanes=0,
                prefix_cache=False,
                speculative=speculative,
            )
            engine = TransformersEngine.from_loaded(loaded, reactor, config)
            engine.start()
            self.addCleanup(engine.stop)
            engines.append(engine)
        runs = []
        for engine in engines:
            for together in (False, True):
                requests = [
                    GenerationRequest(p, gp, 48) for p, gp in zip(prompts, params, strict=True)
                ]
                if together:
                    results = yield defer.gatherResults(
                        [engine.submit(r, lambda *_: None).result for r in requests]
                    )
                else:
                    results = []
                    for r in requests:
                        results.append((yield engine.submit(r, lambda *_: None).result))
                runs.append([list(result.tokens) for result in results])
        for i, run in enumerate(runs[1:], 1):
            self.assertEqual(run, runs[0], i)
        counts = engines[1].statistics().steps
        self.assertGreater(counts.accepted, counts.drafted // 2)
        self.assertGreater(counts.decode_tokens, counts.decode_rows * 1.5)
