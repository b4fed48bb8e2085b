"""Mistral (``model_type`` ``mistral``): Llama's arithmetic with a sliding window over every
layer (``sliding_window``; None in Mistral 7B v0.2 and later).

A GGUF file of a Mistral model says architecture ``llama`` (llama.cpp's converter reads it as
Llama and writes no window), so it is read by :mod:`sfnode.engines.families.llama`: past the
window such a file computes what llama.cpp computes, not what the folder does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import llama_like_config
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("mistral", config)
    window = reader.get("sliding_window")
    return llama_like_config(
        "mistral", reader, generation, sliding_window=int(window) if window else None
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    raise keys.refuse("general.architecture", keys.arch, "is read as llama")


FAMILY = Family("mistral", ("mistral",), (), from_config, from_gguf)
