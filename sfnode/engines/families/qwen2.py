"""Qwen2 and Qwen2.5 (``model_type`` ``qwen2``; GGUF ``qwen2``): Llama's arithmetic with biases
on the query, key and value projections (never on the output one).

Qwen2's own sliding window (``use_sliding_window``) is refused: llama.cpp's converter does not
write it and no released checkpoint turns it on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import (
    config_fields,
    config_rope,
    gguf_biases,
    gguf_fields,
    gguf_rope,
)
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec, plain_scale


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("qwen2", config)
    if reader.get("use_sliding_window", False):
        raise reader.refuse("use_sliding_window", True)
    fields = config_fields(reader, generation)
    return ModelSpec(
        family="qwen2",
        rope=config_rope(reader, fields["head_dim"]),
        attention_scale=plain_scale(fields["head_dim"]),
        qkv_bias=True,
        tied_embeddings=bool(reader.get("tie_word_embeddings", False)),
        **fields,
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    fields = gguf_fields(keys, embed_rows)
    spec = ModelSpec(
        family="qwen2",
        rope=gguf_rope(keys, fields["head_dim"], freqs),
        attention_scale=plain_scale(fields["head_dim"]),
        tied_embeddings="output.weight" not in keys.tensors,
        **gguf_biases(keys),
        **fields,
    )
    keys.refuse_unread()
    return spec


FAMILY = Family("qwen2", ("qwen2",), ("qwen2",), from_config, from_gguf)
