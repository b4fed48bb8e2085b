"""What every family reads the same way: the sizes, the norm epsilon, the rope and the token ids,
from a ``config.json`` (:func:`config_fields`) and from a GGUF file's keys (:func:`gguf_fields`),
the keys llama.cpp's converter writes for every architecture (docs/engine.md section 5.4).

A family module calls these, adds what is its own and builds the :class:`ModelSpec`.  Plain
data: never imports torch at import time, never reads a file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines.families.rope import Rope, llama3_factors, yarn_attention_factor
from sfnode.engines.families.spec import ConfigReader, GgufKeys, ModelSpec, float32, plain_scale

TensorValues = Callable[[str], "list[float] | None"]
"""A GGUF file's small float tensor by name (``rope_freqs``), or None when it has none."""


def config_fields(reader: ConfigReader, generation: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields of a spec every family reads alike from a ``config.json``."""
    heads = reader.count("num_attention_heads")
    hidden = reader.count("hidden_size")
    head_dim = reader.count("head_dim", hidden // heads)
    fields = {
        "vocab_size": reader.count("vocab_size"),
        "hidden": hidden,
        "intermediate": reader.count("intermediate_size"),
        "layers": reader.count("num_hidden_layers"),
        "heads": heads,
        "kv_heads": reader.count("num_key_value_heads", heads),
        "head_dim": head_dim,
        "context_length": reader.count("max_position_embeddings"),
        "norm_eps": reader.number("rms_norm_eps"),
        "bos_id": reader.config.get("bos_token_id"),
        "eos_ids": reader.eos_ids(generation),
    }
    act = reader.get("hidden_act", reader.get("hidden_activation", "silu"))
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise reader.refuse("hidden_act", act)
    fields["activation"] = "silu" if act == "silu" else "gelu_tanh"
    return fields


def config_rope(reader: ConfigReader, head_dim: int, layer_type: str | None = None) -> Rope:
    """The rope of a ``config.json`` (of ``layer_type``'s layers where the config nests it):
    default, linear, dynamic, yarn or llama3; any other kind is refused by name."""
    params = reader.rope_parameters(layer_type)
    base = float32(float(params.get("rope_theta", 10000.0)))
    dims = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return Rope(base, dims)
    if kind in ("linear", "dynamic", "yarn", "llama3") and "factor" not in params:
        raise reader.refuse("rope_parameters", params, "has no factor")
    if kind == "linear":
        return Rope(base, dims, "linear", float32(float(params["factor"])))
    if kind == "dynamic":
        return Rope(
            base,
            dims,
            "dynamic",
            float(params["factor"]),
            context=reader.count("max_position_embeddings"),
        )
    if kind == "llama3":
        factors = llama3_factors(
            dims,
            base,
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
        return Rope(base, dims, "llama3", freq_factors=factors)
    if kind == "yarn":
        return _config_yarn(reader, base, dims, params)
    raise reader.refuse("rope_type", kind)


def _config_yarn(reader: ConfigReader, base: float, dims: int, params: dict[str, Any]) -> Rope:
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key):
            raise reader.refuse(f"rope_parameters.{key}", params[key])
    if params.get("truncate", True) is not True:
        raise reader.refuse("rope_parameters.truncate", params["truncate"])
    factor = float32(float(params["factor"]))
    return Rope(
        base,
        dims,
        "yarn",
        factor,
        original_context=int(params["original_max_position_embeddings"]),
        beta_fast=float32(float(params.get("beta_fast") or 32)),
        beta_slow=float32(float(params.get("beta_slow") or 1)),
        attention_factor=float32(float(params.get("attention_factor") or 0))
        or float32(yarn_attention_factor(factor)),
    )


def gguf_fields(keys: GgufKeys, embed_rows: int) -> dict[str, Any]:
    """The fields of a spec every family reads alike from a GGUF file's keys (``embed_rows``:
    the rows of its token embedding, the vocabulary where no key says it)."""
    heads = keys.count("attention.head_count")
    hidden = keys.count("embedding_length")
    head_dim = keys.count("attention.key_length", hidden // heads)
    if keys.count("attention.value_length", head_dim) != head_dim:
        raise keys.refuse(
            f"{keys.arch}.attention.value_length", keys.value("attention.value_length")
        )
    vocab = keys.count("vocab_size", embed_rows)
    if vocab != embed_rows:
        raise keys.refuse(f"{keys.arch}.vocab_size", vocab, f"but token_embd has {embed_rows}")
    meta = keys.metadata
    eos = {meta[k] for k in ("tokenizer.ggml.eos_token_id",) if isinstance(meta.get(k), int)}
    return {
        "vocab_size": vocab,
        "hidden": hidden,
        "intermediate": keys.count("feed_forward_length"),
        "layers": keys.count("block_count"),
        "heads": heads,
        "kv_heads": keys.count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "context_length": keys.count("context_length"),
        "norm_eps": keys.number("attention.layer_norm_rms_epsilon"),
        "bos_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_ids": tuple(sorted(eos)),
    }


def gguf_rope(keys: GgufKeys, head_dim: int, freqs: TensorValues) -> Rope:
    """The rope a GGUF file's keys say (``rope.freq_base``, ``rope.dimension_count``,
    ``rope.scaling.*``) and its ``rope_freqs`` tensor (llama3's per-frequency factors)."""
    base = keys.number("rope.freq_base", 10000.0)
    dims = keys.count("rope.dimension_count", head_dim)
    kind = keys.value("rope.scaling.type", "none")
    factors = freqs("rope_freqs.weight")
    if factors is not None:
        if kind != "none":
            raise keys.refuse(f"{keys.arch}.rope.scaling.type", kind, "beside rope_freqs")
        return Rope(base, dims, "llama3", freq_factors=tuple(factors))
    if kind == "none":
        keys.refuse_value("rope.scaling.factor", (1, 1.0))
        return Rope(base, dims)
    factor = keys.number("rope.scaling.factor")
    if kind == "linear":
        return Rope(base, dims, "linear", factor)
    if kind == "yarn":
        return _gguf_yarn(keys, base, dims, factor)
    raise keys.refuse(f"{keys.arch}.rope.scaling.type", kind)


def _gguf_yarn(keys: GgufKeys, base: float, dims: int, factor: float) -> Rope:
    keys.refuse_value("rope.scaling.yarn_ext_factor", (1, 1.0))
    return Rope(
        base,
        dims,
        "yarn",
        factor,
        original_context=keys.count("rope.scaling.original_context_length"),
        beta_fast=keys.number("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=keys.number("rope.scaling.yarn_beta_slow", 1.0),
        attention_factor=keys.number(
            "rope.scaling.yarn_attn_factor", float32(yarn_attention_factor(factor))
        ),
    )


def gguf_biases(keys: GgufKeys) -> dict[str, Any]:
    """Which projections have biases, from the tensors of the file's first layer."""
    has = keys.tensors.__contains__
    return {
        "qkv_bias": has("blk.0.attn_q.bias") or has("blk.0.attn_qkv.bias"),
        "o_bias": has("blk.0.attn_output.bias"),
        "mlp_bias": has("blk.0.ffn_up.bias"),
    }


def llama_like_config(
    family: str, reader: ConfigReader, generation: Mapping[str, Any] | None, **own: Any
) -> ModelSpec:
    """The spec of a family that is Llama's arithmetic plus ``own`` fields, from a
    ``config.json``."""
    fields = config_fields(reader, generation)
    return ModelSpec(
        family=family,
        rope=config_rope(reader, fields["head_dim"]),
        attention_scale=plain_scale(fields["head_dim"]),
        tied_embeddings=bool(reader.get("tie_word_embeddings", False)),
        **fields,
        **own,
    )


def llama_like_gguf(
    family: str, keys: GgufKeys, freqs: TensorValues, embed_rows: int, **own: Any
) -> ModelSpec:
    """The same from a GGUF file (biases said by the tensors), once every key is read."""
    fields = gguf_fields(keys, embed_rows)
    own = {**gguf_biases(keys), **own}
    spec = ModelSpec(
        family=family,
        rope=gguf_rope(keys, fields["head_dim"], freqs),
        attention_scale=plain_scale(fields["head_dim"]),
        tied_embeddings="output.weight" not in keys.tensors,
        **fields,
        **own,
    )
    keys.refuse_unread()
    return spec


__all__ = [
    "config_fields",
    "config_rope",
    "gguf_biases",
    "gguf_fields",
    "gguf_rope",
    "llama_like_config",
    "llama_like_gguf",
]
