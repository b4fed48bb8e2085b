"""Tests of sfnode.engines.llama_step: the lean decode step equals the model's own forward.

Tiny random Llamas built from a config (nothing is downloaded), left-padded batches as the engine
keeps them, compared bit for bit with ``model(...)`` over several steps; a decode step fused with
a prompt chunk is compared with the two separate forwards.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from twisted.trial import unittest

from sfnode.engines.kernels import lane_cache
from sfnode.engines.llama_step import LlamaStep
from tests.tinymodel import tiny_llama


def prefilled(model: Any, lengths: list[int], seed: int) -> tuple[Any, Any, torch.Tensor]:
    """Two caches holding the same left-padded prompts of ``lengths``, and the padding."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    pad = torch.tensor([width - n for n in lengths])
    ids = torch.randint(3, int(model.config.vocab_size), (len(lengths), width), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) >= pad.unsqueeze(1)).to(torch.long)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    caches = []
    for _ in range(2):
        cache = lane_cache(model.config)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
        caches.append(cache)
    return caches[0], caches[1], pad


def model_decode(
    model: Any, tokens: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor, cache: Any
) -> torch.Tensor:
    """One decode step through ``model(...)`` itself, with the padding mask the engine gives."""
    length = cache.get_seq_length() + 1
    mask = (torch.arange(length).unsqueeze(0) >= pad.unsqueeze(1)).to(torch.long)
    logits: torch.Tensor = model(
        input_ids=tokens,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        logits_to_keep=1,
    ).logits[:, -1, :]
    return logits


class LlamaStepTests(unittest.SynchronousTestCase):
    """LlamaStep's logits are exactly the model's, and it declines models it does not copy."""

    def assert_steps_equal(self, model: Any, lengths: list[int], steps: int = 6) -> None:
        step = LlamaStep.for_model(model)
        assert step is not None
        with torch.inference_mode():
            theirs, ours, pad = prefilled(model, lengths, seed=len(lengths))
            tokens = torch.full((len(lengths), 1), 7)
            for i in range(steps):
                positions = (max(lengths) - pad + i).view(-1, 1)
                want = model_decode(model, tokens, positions, pad, theirs)
                got = step.logits(tokens, positions, pad, ours)
                self.assertTrue(torch.equal(got, want), f"step {i}: logits differ")
                tokens = want.argmax(-1, keepdim=True)
        self.assertEqual(ours.get_seq_length(), theirs.get_seq_length())

    def test_padded_lanes_equal_the_model(self) -> None:
        """Lanes of different lengths (left padding, grouped key/value heads) match exactly."""
        self.assert_steps_equal(tiny_llama(), [5, 31, 17, 2])

    def test_unpadded_lanes_equal_the_model(self) -> None:
        """Lanes of one length (no padding mask at all) and a single lane match exactly."""
        self.assert_steps_equal(tiny_llama(), [12, 12, 12])
        self.assert_steps_equal(tiny_llama(), [9])

    def test_one_key_value_head_per_query_head(self) -> None:
        """A model without grouped-query attention matches exactly too."""
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            initializer_range=0.2,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(3)
        self.assert_steps_equal(LlamaForCausalLM(config).eval(), [4, 11])

    def test_chunk_rides_along_with_the_decode_step(self) -> None:
        """A decode step fused with another lane's prompt chunk (first chunk and a later one)
        gives the logits of the two separate forwards, to float32 rounding, and leaves both
        caches as the separate forwards would."""
        model = tiny_llama()
        step = LlamaStep.for_model(model)
        assert step is not None
        generator = torch.Generator().manual_seed(11)
        prompt = torch.randint(3, int(model.config.vocab_size), (1, 40), generator=generator)
        with torch.inference_mode():
            theirs, ours, pad = prefilled(model, [6, 19, 13], seed=4)
            lane_theirs, lane_ours = lane_cache(model.config), lane_cache(model.config)
            tokens = torch.full((3, 1), 9)
            for i, (start, end) in enumerate([(0, 25), (25, 40)]):
                positions = (19 - pad + i).view(-1, 1)
                want = model_decode(model, tokens, positions, pad, theirs)
                want_chunk = model(
                    input_ids=prompt[:, start:end],
                    position_ids=torch.arange(start, end).unsqueeze(0),
                    cache=lane_theirs,
                    logits_to_keep=1,
                ).logits[:, -1, :]
                got, got_chunk = step.logits_with_chunk(
                    tokens, positions, pad, ours, prompt[:, start:end], lane_ours
                )
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_chunk, want_chunk, rtol=1e-5, atol=1e-5)
                tokens = want.argmax(-1, keepdim=True)
        for mine, reference in ((ours, theirs), (lane_ours, lane_theirs)):
            self.assertEqual(mine.get_seq_length(), reference.get_seq_length())
            for a, b in zip(mine.layers, reference.layers, strict=True):
                torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)

    def test_declines_what_it_does_not_reproduce(self) -> None:
        """Eager attention, half precision and other architectures get no lean step."""
        self.assertIsNotNone(LlamaStep.for_model(tiny_llama()))
        self.assertIsNone(LlamaStep.for_model(tiny_llama(attn="eager")))
        self.assertIsNone(LlamaStep.for_model(tiny_llama().to(torch.bfloat16)))
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2 = GPT2LMHeadModel(
            GPT2Config(
                n_embd=32, n_layer=1, n_head=2, vocab_size=100, bos_token_id=1, eos_token_id=2
            )
        )
        self.assertIsNone(LlamaStep.for_model(gpt2))
