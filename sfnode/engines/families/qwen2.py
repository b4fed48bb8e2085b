"""Qwen2 and Qwen2.5 (``model_type`` ``qwen2``; GGUF ``qwen2``): Llama's arithmetic with biases
on the query, key and value projections (never on the output one).

Qwen2's own sliding window (``use_sliding_window``) is refused: llama.cpp's converter does not
write it and no released checkpoint turns it on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import llama_like_config, llama_like_gguf
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("qwen2", config)
    if reader.get("use_sliding_window", False):
        raise reader.refuse("use_sliding_window", True)
    return llama_like_config("qwen2", reader, generation, qkv_bias=True)


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    return llama_like_gguf("qwen2", keys, freqs, embed_rows)


FAMILY = Family("qwen2", ("qwen2",), ("qwen2",), from_config, from_gguf)
