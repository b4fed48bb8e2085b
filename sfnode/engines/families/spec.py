"""sfnode's own description of a model: :class:`ModelSpec`, every hyperparameter the runners
need, whatever the files it was read from (docs/engine.md section 5.4).

A spec is read from a Hugging Face ``config.json`` or from a GGUF file's metadata by the
model's family (one module per family beside this one); the same model gives the same spec
from both.  The two readers' helpers live here: :class:`ConfigReader` reads a ``config.json``
dict, :class:`GgufKeys` reads the ``{arch}.*`` keys of a GGUF file and remembers which it read,
so that a key nobody read is refused by name (:meth:`GgufKeys.refuse_unread`) rather than
dropped.

Plain data: this module never imports torch and never reads a file.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sfnode.engines import ModelLoadError, ModelRefused
from sfnode.engines.families.rope import Rope

NORMS = frozenset({"attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm", "q_norm", "k_norm"})
"""The per-layer norm weights of :mod:`sfnode.engines.weights.stored`'s names (with
``final_norm``, the ones a norm offset applies to)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a decoder-only model computes, for every family sfnode serves."""

    family: str
    """The family module that read it (``llama``, ``qwen2``, ...)."""
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context_length: int
    norm_eps: float
    rope: Rope
    attention_scale: float
    """What a query-key product is multiplied by before the softmax."""
    local_rope: Rope | None = None
    """The rope of the sliding-window layers where it differs (Gemma 3)."""
    norm_offset: float = 0.0
    """Added to a folder's norm weights (Gemma: ``x * (1 + w)``); a GGUF file stores them
    with it added, and the reader gives both the same weights."""
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` or ``gelu_tanh``."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """An RMS norm over each head of the queries and keys before the rotation (Qwen3, Gemma 3)."""
    sandwich_norms: bool = False
    """Norms after the attention and after the MLP too, before each residual add (Gemma 2/3)."""
    sliding_window: int | None = None
    """Keys a sliding-window layer attends to (its own position included), or None."""
    sliding_layers: tuple[bool, ...] = ()
    """Per layer, whether it uses the sliding window (all, when the window is set and this is
    empty)."""
    attn_softcap: float | None = None
    """Gemma 2: attention scores become ``cap * tanh(score / cap)``."""
    final_softcap: float | None = None
    """Gemma 2: logits become ``cap * tanh(logit / cap)``."""
    embed_scale: float | None = None
    """Gemma: the embedded token is multiplied by this (``sqrt(hidden)``)."""
    fused_qkv: bool = False
    """Phi-3: the files hold one query/key/value matrix (split by rows when read)."""
    fused_gate_up: bool = False
    """Phi-3: the files hold one gate/up matrix, gate rows first."""
    tied_embeddings: bool = False
    """The output head is the embedding table."""
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.sliding_layers[layer] if self.sliding_layers else True

    def rope_of(self, layer: int) -> Rope:
        """The rope ``layer`` rotates with."""
        if self.local_rope is not None and self.is_sliding(layer):
            return self.local_rope
        return self.rope

    def refuse(self, what: str) -> ModelLoadError:
        """The error that refuses this model for ``what`` it needs."""
        return ModelRefused(f"{self.family}: {what} is not supported")


def float32(value: float) -> float:
    """``value`` rounded to float32: a GGUF file holds its numbers so, and the arithmetic uses
    them so; a ``config.json``'s are rounded alike so that both give one spec."""
    packed: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return packed


def plain_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class ConfigReader:
    """A Hugging Face ``config.json`` (its ``text_config`` merged in) read for ``family``."""

    def __init__(self, family: str, config: Mapping[str, Any]) -> None:
        merged = dict(config)
        merged.update(config.get("text_config") or {})
        self.family = family
        self.config = merged

    def refuse(self, key: str, value: Any, why: str = "is not supported") -> ModelLoadError:
        return ModelRefused(f"{self.family}: config.json {key} = {value!r} {why}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def count(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(key, value, "is not a count")
        return value

    def number(self, key: str, default: float | None = None) -> float:
        """``key`` as a float32 (what a GGUF file holds, and what the arithmetic uses)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(key, value, "is not a number")
        return float32(value)

    def optional_number(self, key: str) -> float | None:
        """:meth:`number` of ``key``, or None where it is absent, null or 0."""
        return self.number(key) if self.get(key) else None

    def eos_ids(self, generation: Mapping[str, Any] | None) -> tuple[int, ...]:
        """The end-of-sequence ids of the config and of ``generation_config.json``."""
        found: set[int] = set()
        for source in (self.config, generation or {}):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                found.add(value)
            elif isinstance(value, list):
                found.update(v for v in value if isinstance(v, int))
        return tuple(sorted(found))

    def rope_parameters(self, layer_type: str | None = None) -> dict[str, Any]:
        """The rope parameters in transformers' newer form (``rope_parameters``, per layer type
        where the config nests them), from the older ``rope_theta``/``rope_scaling`` too."""
        params = self.config.get("rope_parameters")
        if isinstance(params, Mapping):
            if layer_type is not None and isinstance(params.get(layer_type), Mapping):
                return dict(params[layer_type])
            if isinstance(params.get("full_attention"), Mapping):
                return dict(params["full_attention"])
            return dict(params)
        found = dict(self.config.get("rope_scaling") or {})
        if "type" in found and "rope_type" not in found:
            found["rope_type"] = found.pop("type")
        if "rope_theta" in self.config:
            found["rope_theta"] = self.config["rope_theta"]
        return found


class GgufKeys:
    """A GGUF file's metadata read for architecture ``arch``: each ``{arch}.*`` key read is
    remembered, so that :meth:`refuse_unread` can refuse the ones no reader took."""

    def __init__(self, arch: str, metadata: Mapping[str, Any], tensors: frozenset[str]) -> None:
        self.arch = arch
        self.metadata = metadata
        self.tensors = tensors
        """The names of the file's tensors (a bias is said by its presence)."""
        self.read: set[str] = set()

    def refuse(self, key: str, value: Any, why: str = "is not supported") -> ModelLoadError:
        return ModelRefused(f"{self.arch}: GGUF key {key} = {value!r} {why}")

    def has(self, name: str) -> bool:
        return f"{self.arch}.{name}" in self.metadata

    def value(self, name: str, default: Any = None) -> Any:
        key = f"{self.arch}.{name}"
        self.read.add(key)
        if key not in self.metadata:
            if default is None:
                raise ModelLoadError(f"{self.arch}: the GGUF file has no {key}")
            return default
        return self.metadata[key]

    def count(self, name: str, default: int | None = None) -> int:
        value = self.value(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(f"{self.arch}.{name}", value, "is not one count")
        return value

    def number(self, name: str, default: float | None = None) -> float:
        value = self.value(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(f"{self.arch}.{name}", value, "is not one number")
        return float(value)

    def refuse_value(self, name: str, allowed: tuple[Any, ...]) -> None:
        """Read ``name`` (when present) and refuse any value but ``allowed``."""
        if self.has(name):
            value = self.value(name)
            if value not in allowed:
                raise self.refuse(f"{self.arch}.{name}", value)

    def refuse_unread(self) -> None:
        """Refuse the first ``{arch}.*`` key no reader took: a hyperparameter the family does
        not know is never dropped."""
        prefix = f"{self.arch}."
        for key in sorted(self.metadata):
            if key.startswith(prefix) and key not in self.read:
                raise self.refuse(key, self.metadata[key])


@dataclass(frozen=True)
class Family:
    """One model family: the names it answers to and its two readers."""

    name: str
    model_types: tuple[str, ...]
    """The ``model_type`` values of a ``config.json`` it reads."""
    architectures: tuple[str, ...]
    """The ``general.architecture`` values of a GGUF file it reads."""
    from_config: Callable[[Mapping[str, Any], Mapping[str, Any] | None], ModelSpec]
    """``(config.json, generation_config.json or None) -> spec``."""
    from_gguf: Callable[[GgufKeys, Callable[[str], list[float] | None], int], ModelSpec]
    """``(keys, small tensor by name, token embedding rows) -> spec``; it must read or refuse
    every ``{arch}.*`` key."""
    gguf_permutes_qk: bool = False
    """llama.cpp's converter interleaves the rotary halves of each head's query and key rows
    (and biases) for this architecture; the reader puts them back."""


__all__ = ["NORMS", "ConfigReader", "Family", "GgufKeys", "ModelSpec", "plain_scale"]
