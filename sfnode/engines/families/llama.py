"""Llama 1-3.x (``model_type`` ``llama``; GGUF ``llama``), and every GGUF file of architecture
``llama`` (llama.cpp's converter writes Mistral's as ``llama`` too, without its window).

Rope: default, linear, dynamic, yarn or llama3 (a GGUF file holds llama3's as its
``rope_freqs`` tensor); optional biases (``attention_bias``: query, key, value and output;
``mlp_bias``); the converter permutes the query and key rows, which the reader undoes.
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
    reader = ConfigReader("llama", config)
    fields = config_fields(reader, generation)
    bias = bool(reader.get("attention_bias", False))
    return ModelSpec(
        family="llama",
        rope=config_rope(reader, fields["head_dim"]),
        attention_scale=plain_scale(fields["head_dim"]),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(reader.get("mlp_bias", False)),
        tied_embeddings=bool(reader.get("tie_word_embeddings", False)),
        **fields,
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    fields = gguf_fields(keys, embed_rows)
    spec = ModelSpec(
        family="llama",
        rope=gguf_rope(keys, fields["head_dim"], freqs),
        attention_scale=plain_scale(fields["head_dim"]),
        tied_embeddings="output.weight" not in keys.tensors,
        **gguf_biases(keys),
        **fields,
    )
    keys.refuse_unread()
    return spec


FAMILY = Family("llama", ("llama",), ("llama",), from_config, from_gguf, gguf_permutes_qk=True)
