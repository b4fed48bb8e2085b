"""Qwen3 (``model_type`` ``qwen3``; GGUF ``qwen3``): Llama's arithmetic with an RMS norm over
each head of the queries and keys before the rotation (``q_norm``, ``k_norm``), a head size of
its own (``head_dim``), and optional biases (``attention_bias``).
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
    reader = ConfigReader("qwen3", config)
    if reader.get("use_sliding_window", False):
        raise reader.refuse("use_sliding_window", True)
    fields = config_fields(reader, generation)
    bias = bool(reader.get("attention_bias", False))
    return ModelSpec(
        family="qwen3",
        rope=config_rope(reader, fields["head_dim"]),
        attention_scale=plain_scale(fields["head_dim"]),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        tied_embeddings=bool(reader.get("tie_word_embeddings", False)),
        **fields,
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    fields = gguf_fields(keys, embed_rows)
    spec = ModelSpec(
        family="qwen3",
        rope=gguf_rope(keys, fields["head_dim"], freqs),
        attention_scale=plain_scale(fields["head_dim"]),
        qk_norm=True,
        tied_embeddings="output.weight" not in keys.tensors,
        **gguf_biases(keys),
        **fields,
    )
    keys.refuse_unread()
    return spec


FAMILY = Family("qwen3", ("qwen3",), ("qwen3",), from_config, from_gguf)
