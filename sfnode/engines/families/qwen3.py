"""Qwen3 (``model_type`` ``qwen3``; GGUF ``qwen3``): Llama's arithmetic with an RMS norm over
each head of the queries and keys before the rotation (``q_norm``, ``k_norm``), a head size of
its own (``head_dim``), and optional biases (``attention_bias``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import llama_like_config, llama_like_gguf
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("qwen3", config)
    if reader.get("use_sliding_window", False):
        raise reader.refuse("use_sliding_window", True)
    bias = bool(reader.get("attention_bias", False))
    return llama_like_config("qwen3", reader, generation, qkv_bias=bias, o_bias=bias, qk_norm=True)


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    return llama_like_gguf("qwen3", keys, freqs, embed_rows, qk_norm=True)


FAMILY = Family("qwen3", ("qwen3",), ("qwen3",), from_config, from_gguf)
