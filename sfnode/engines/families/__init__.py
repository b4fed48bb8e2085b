"""The model families sfnode serves, one module each (``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``gemma2``, ``gemma3``, ``phi3``), and sfnode's own description of a model that they
read (:class:`~sfnode.engines.families.spec.ModelSpec`, docs/engine.md section 5.4).

A family is chosen by a ``config.json``'s ``model_type`` or a GGUF file's
``general.architecture``; one that no family answers to is refused with its name, and so is any
value a family does not support.  :func:`spec_from_config` and :func:`spec_from_gguf` are the
two doors.

May import ``sfnode.engines`` (for :class:`~sfnode.engines.ModelLoadError`) and nothing else of
sfnode; plain data, torch only inside the functions that build rope tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sfnode.engines import ModelLoadError, ModelRefused
from sfnode.engines.families import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from sfnode.engines.families.spec import Family, GgufKeys, ModelSpec

FAMILIES: tuple[Family, ...] = tuple(
    module.FAMILY for module in (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3)
)


def family_of_config(config: Mapping[str, Any]) -> Family:
    """The family of a ``config.json`` (by its ``model_type``), or refused by name."""
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise ModelRefused(f"model_type {model_type!r} is not supported (sfnode reads {known})")


def family_of_architecture(arch: Any) -> Family:
    """The family of a GGUF file's ``general.architecture``, or refused by name."""
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ModelRefused(f"GGUF architecture {arch!r} is not supported (sfnode reads {known})")


def spec_from_config(
    config: Mapping[str, Any], generation: Mapping[str, Any] | None = None
) -> ModelSpec:
    """The spec of a Hugging Face folder's ``config.json`` (and ``generation_config.json``)."""
    return family_of_config(config).from_config(config, generation)


def spec_from_gguf(
    metadata: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    small: Callable[[str], list[float] | None],
) -> ModelSpec:
    """The spec of a GGUF file: its metadata, its tensors' shapes (as stored: the row length
    first) and a reader of its small float tensors (``rope_freqs``)."""
    arch = metadata.get("general.architecture")
    family = family_of_architecture(arch)
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelLoadError(f"{arch}: the GGUF file has no token_embd.weight matrix")
    keys = GgufKeys(str(arch), metadata, frozenset(shapes))
    return family.from_gguf(keys, small, embed[1])


__all__ = [
    "FAMILIES",
    "ModelSpec",
    "family_of_architecture",
    "family_of_config",
    "spec_from_config",
    "spec_from_gguf",
]
