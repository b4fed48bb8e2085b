"""Gemma 2 (``model_type`` ``gemma2``; GGUF ``gemma2``): norms of ``x * (1 + w)`` before and
after both the attention and the MLP, a GELU (tanh) gated MLP, the embedding scaled by
``sqrt(hidden)``, attention scores and logits soft-capped (``cap * tanh(x / cap)``), every other
layer (the first included) attending through a sliding window, and queries scaled by
``query_pre_attn_scalar ** -0.5``.

A GGUF file stores the norms with the 1 added and no query scale: llama.cpp's rule is used
(``hidden / heads`` for the 46-layer 27B model, the head size otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import config_fields, config_rope, gguf_fields, gguf_rope
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def sliding_layers(reader: ConfigReader, layers: int, every: int) -> tuple[bool, ...]:
    """Per layer, whether it uses the window: from ``layer_types``, else every ``every``-th
    layer is a full one (the others slide)."""
    types = reader.get("layer_types")
    if types is None:
        every = reader.count("sliding_window_pattern", every)
        return tuple((i + 1) % every != 0 for i in range(layers))
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise reader.refuse("layer_types", types)
    return tuple(t == "sliding_attention" for t in types)


def gguf_sliding_layers(keys: GgufKeys, layers: int, every: int) -> tuple[bool, ...]:
    """The same from a GGUF file: ``attention.sliding_window_pattern`` (a period, or one flag a
    layer) or llama.cpp's default period for the architecture."""
    pattern = keys.value("attention.sliding_window_pattern", every)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise keys.refuse(f"{keys.arch}.attention.sliding_window_pattern", pattern)
        return tuple(bool(p) for p in pattern)
    return tuple(i % int(pattern) < int(pattern) - 1 for i in range(layers))


def gguf_query_scale(fields: dict[str, Any], big_layers: int) -> float:
    """llama.cpp's query scale for Gemma: ``hidden / heads`` for the 27B model, else the head
    size (a GGUF file does not say ``query_pre_attn_scalar``)."""
    if fields["layers"] == big_layers:
        return 1.0 / math.sqrt(fields["hidden"] // fields["heads"])
    return 1.0 / math.sqrt(fields["head_dim"])


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("gemma2", config)
    fields = config_fields(reader, generation)
    if reader.get("attention_bias", False):
        raise reader.refuse("attention_bias", True)
    return ModelSpec(
        family="gemma2",
        rope=config_rope(reader, fields["head_dim"]),
        attention_scale=reader.number("query_pre_attn_scalar") ** -0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        sliding_window=reader.count("sliding_window"),
        sliding_layers=sliding_layers(reader, fields["layers"], 2),
        attn_softcap=reader.optional_number("attn_logit_softcapping"),
        final_softcap=reader.optional_number("final_logit_softcapping"),
        embed_scale=math.sqrt(fields["hidden"]),
        tied_embeddings=bool(reader.get("tie_word_embeddings", True)),
        **fields,
    )


def from_gguf(
    keys: GgufKeys, freqs: Callable[[str], list[float] | None], embed_rows: int
) -> ModelSpec:
    fields = gguf_fields(keys, embed_rows)
    rope = gguf_rope(keys, fields["head_dim"], freqs)
    keys.refuse_value("rope.freq_base_swa", (rope.base,))
    attn_cap = keys.number("attn_logit_softcapping", 0.0)
    final_cap = keys.number("final_logit_softcapping", 0.0)
    spec = ModelSpec(
        family="gemma2",
        rope=rope,
        attention_scale=gguf_query_scale(fields, 46),
        norm_offset=1.0,
        activation="gelu_tanh",
        sandwich_norms=True,
        sliding_window=keys.count("attention.sliding_window", 4096),
        sliding_layers=gguf_sliding_layers(keys, fields["layers"], 2),
        attn_softcap=attn_cap or None,
        final_softcap=final_cap or None,
        embed_scale=math.sqrt(fields["hidden"]),
        tied_embeddings="output.weight" not in keys.tensors,
        **fields,
    )
    keys.refuse_unread()
    return spec


FAMILY = Family("gemma2", ("gemma2",), ("gemma2",), from_config, from_gguf)
