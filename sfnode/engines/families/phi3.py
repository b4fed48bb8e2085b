"""Phi-3 (``model_type`` ``phi3``; GGUF ``phi3``): Llama's arithmetic with the query, key and
value projections stored as one matrix (``qkv_proj``; ``attn_qkv``) and the gate and up
projections as one (``gate_up_proj``; the GGUF file's ``ffn_up``, gate rows first), which the
reader splits by rows; optionally a partial rotation (``partial_rotary_factor``) and a sliding
window over every layer.

The long-context ``longrope`` scaling (Phi-3 128k: ``long_factor``/``short_factor``; a GGUF
file's ``rope_factors_long`` and ``rope.scaling.attn_factor``) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import llama_like_config, llama_like_gguf
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("phi3", config)
    window = reader.get("sliding_window")
    return llama_like_config(
        "phi3",
        reader,
        generation,
        sliding_window=int(window) if window else None,
        fused_qkv=True,
        fused_gate_up=True,
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    if "rope_factors_long.weight" in keys.tensors:
        raise keys.refuse("rope_factors_long", "(a tensor)", "(longrope scaling) is not supported")
    keys.count("rope.scaling.original_context_length", 0)  # only longrope uses it
    window = keys.count("attention.sliding_window", 0)
    return llama_like_gguf(
        "phi3",
        keys,
        freqs,
        embed_rows,
        sliding_window=window or None,
        fused_qkv=True,
        fused_gate_up=True,
    )


FAMILY = Family("phi3", ("phi3",), ("phi3",), from_config, from_gguf)
