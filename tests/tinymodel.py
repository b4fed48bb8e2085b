"""Tiny random Llama models and tokenizers for tests and benchmarks, built on the spot.

Nothing here downloads anything: the model comes from a ``LlamaConfig`` with a fixed seed and the
tokenizer is trained with the ``tokenizers`` package on a few sentences.  This module must never
touch the network or a user cache, and must stay quick (well under a second per model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_VOCAB = 512
TINY_EOS = 2
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The tiny tokenizer's chat template (saved with it, so the head renders chat through it as
through any model's): ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a node agent serves language models to a fleet head",
    "tokens stream back in order and each exactly once",
    "hello world, this is a tiny tokenizer for tests",
    "lanes decode together and the kv cache is counted in blocks",
]


def tiny_llama(
    *,
    hidden: int = 64,
    layers: int = 3,
    vocab: int = TINY_VOCAB,
    window: int = 256,
    seed: int = 1234,
    init_range: float = 0.2,
    eos: int | None = TINY_EOS,
    attn: str = "sdpa",
    bias: bool = False,
) -> Any:
    """A random ``LlamaForCausalLM`` in float32 eval mode (same seed, same weights).

    ``init_range`` is larger than the usual 0.02 so that logits are well separated and greedy
    choices do not hinge on the last bits of a float (batched and solo matmuls round differently).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        initializer_range=init_range,
        attention_bias=bias,
        mlp_bias=bias,
        bos_token_id=1,
        eos_token_id=eos,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    model.eval()
    return model


def tiny_llama_random_norms(
    *, norm_range: tuple[float, float] = (0.4, 1.6), **settings: Any
) -> Any:
    """A random ``LlamaForCausalLM`` whose every RMSNorm weight is random and far from 1.0.

    :func:`tiny_llama` leaves every norm weight at 1.0, so code that skips a norm's weight (or a
    whole final norm: RMSNorm then only rescales, which an argmax ignores) computes the same
    tokens.  Here each weight of every RMSNorm (both per layer and the final one) is drawn
    uniformly from ``norm_range``, and with ``bias`` the attention and MLP projections get
    random biases too (Llama has them as a config option), so such code gives other logits and,
    within a few tokens, other tokens.  ``settings`` are :func:`tiny_llama`'s (here 4 layers, a
    window of 512, seed 4321, biases).  Same arguments, same weights; float32, eval mode.
    """
    import torch

    settings = {"layers": 4, "window": 512, "seed": 4321, "bias": True, **settings}
    model = tiny_llama(**settings)
    seed = settings["seed"]
    init_range = settings.get("init_range", 0.2)
    generator = torch.Generator().manual_seed(seed + 1)
    low, high = norm_range
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                weight = module.weight
                weight.copy_(low + (high - low) * torch.rand(weight.shape, generator=generator))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                bias_values = torch.randn(module.bias.shape, generator=generator)
                module.bias.copy_(init_range * bias_values)
    return model


def tiny_tokenizer(vocab: int = TINY_VOCAB) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, as ``PreTrainedTokenizerFast``,
    with :data:`TINY_CHAT_TEMPLATE` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(folder: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write a tiny Llama and its tokenizer as a transformers folder; returns the folder."""
    return _save_with_tokenizer(folder, tiny_llama(**kwargs))


def save_tiny_random_norms_model(folder: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`tiny_llama_random_norms` and the tiny tokenizer as a transformers folder."""
    return _save_with_tokenizer(folder, tiny_llama_random_norms(**kwargs))


def _save_with_tokenizer(folder: str | os.PathLike[str], model: Any) -> Path:
    """Write ``model`` and the tiny tokenizer as a transformers folder; returns the folder."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path


def reference_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """``model.generate(do_sample=False)`` new tokens for one prompt (stops at EOS)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
