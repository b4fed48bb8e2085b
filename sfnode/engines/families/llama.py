"""Llama 1-3.x (``model_type`` ``llama``; GGUF ``llama``), and every GGUF file of architecture
``llama`` (llama.cpp's converter writes Mistral's as ``llama`` too, without its window).

Rope: default, linear, dynamic, yarn or llama3 (a GGUF file holds llama3's as its
``rope_freqs`` tensor); optional biases (``attention_bias``: query, key, value and output;
``mlp_bias``); the converter permutes the query and key rows, which the reader undoes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import llama_like_config, llama_like_gguf
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("llama", config)
    bias = bool(reader.get("attention_bias", False))
    return llama_like_config(
        "llama",
        reader,
        generation,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(reader.get("mlp_bias", False)),
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    return llama_like_gguf("llama", keys, freqs, embed_rows)


FAMILY = Family("llama", ("llama",), ("llama",), from_config, from_gguf, gguf_permutes_qk=True)
