"""Gemma 3's text model (``model_type`` ``gemma3_text``; GGUF ``gemma3``): Gemma 2's layer
(norms of ``x * (1 + w)`` around both halves, GELU (tanh), the scaled embedding) with q/k RMS
norms instead of attention soft-capping, five sliding-window layers to one full one, and a rope
of their own for the sliding layers (``rope_parameters.sliding_attention``; the GGUF file's
``rope.freq_base_swa``), unscaled, while the full layers' rope may be scaled.

Multimodal Gemma 3 folders (``model_type`` ``gemma3``) are not read: their text weights live
under other names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.common import config_fields, config_rope, gguf_fields, gguf_rope
from sfnode.engines.families.gemma2 import gguf_query_scale, gguf_sliding_layers, sliding_layers
from sfnode.engines.families.rope import Rope
from sfnode.engines.families.spec import ConfigReader, Family, GgufKeys, ModelSpec


def _local_rope(reader: ConfigReader, head_dim: int) -> Rope:
    if "rope_local_base_freq" in reader.config:
        return Rope(reader.number("rope_local_base_freq"), head_dim)
    return config_rope(reader, head_dim, "sliding_attention")


def from_config(config: Mapping[str, Any], generation: Mapping[str, Any] | None) -> ModelSpec:
    reader = ConfigReader("gemma3", config)
    fields = config_fields(reader, generation)
    for key in ("attention_bias", "attn_logit_softcapping", "use_bidirectional_attention"):
        if reader.get(key):
            raise reader.refuse(key, reader.get(key))
    window = reader.get("sliding_window")
    return ModelSpec(
        family="gemma3",
        rope=config_rope(reader, fields["head_dim"], "full_attention"),
        local_rope=_local_rope(reader, fields["head_dim"]),
        attention_scale=reader.number("query_pre_attn_scalar") ** -0.5,
        norm_offset=1.0,
        qk_norm=True,
        sandwich_norms=True,
        sliding_window=int(window) if window else None,
        sliding_layers=sliding_layers(reader, fields["layers"], 6) if window else (),
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
    window = keys.count("attention.sliding_window", 0)
    final_cap = keys.number("final_logit_softcapping", 0.0)
    spec = ModelSpec(
        family="gemma3",
        rope=rope,
        local_rope=Rope(keys.number("rope.freq_base_swa", rope.base), rope.dims),
        attention_scale=gguf_query_scale(fields, 62),
        norm_offset=1.0,
        activation="gelu_tanh",
        qk_norm=True,
        sandwich_norms=True,
        sliding_window=window or None,
        sliding_layers=gguf_sliding_layers(keys, fields["layers"], 6) if window else (),
        final_softcap=final_cap or None,
        embed_scale=math.sqrt(fields["hidden"]),
        tied_embeddings="output.weight" not in keys.tensors,
        **fields,
    )
    keys.refuse_unread()
    return spec


FAMILY = Family("gemma3", ("gemma3_text",), ("gemma3",), from_config, from_gguf)
