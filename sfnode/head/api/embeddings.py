"""OpenAI's ``/v1/embeddings``, its request and its answer (docs/api.md "/v1/embeddings"),
built by pure functions: the mirror of :mod:`sfnode.head.api.schema` and
:mod:`sfnode.head.api.bodies` for embeddings.

- :func:`parse_embeddings` checks a body: ``model``, ``input`` (a string or an array of up to
  :data:`MAX_INPUTS` strings of at most :data:`MAX_CHARACTERS` characters; token arrays are
  refused: the node tokenizes with the model's own tokenizer), ``encoding_format`` (``float``
  or ``base64``, what the ``openai`` package asks by default), ``dimensions`` refused (a
  model's vectors keep their length), ``user`` ignored.
- :func:`chunks` cuts the texts into the EMBED_REQ of at most :data:`PER_REQUEST` texts each
  (docs/protocol.md section 12.7).
- :func:`embeddings_body` writes the answer: one ``embedding`` object per input, in order, its
  vector as JSON numbers or as the base64 of its little-endian float32 bytes.

This module must never touch a request, the reactor or a clock, and never raise anything but
:class:`~sfnode.runtime.http_guard.HttpError` for a body.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sfnode.generation import Embedded
from sfnode.head.api.schema import checked_text, model_not_found
from sfnode.runtime.http_guard import HttpError, clip

MAX_INPUTS = 2048
"""Inputs in one request, as OpenAI allows."""
MAX_CHARACTERS = 32768
"""Characters of one input (the node cuts a text to its model's longest input anyway)."""
PER_REQUEST = 64
"""Texts in one EMBED_REQ: its answer (64 vectors of up to 16,384 float32) fits a frame."""
_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    """A checked ``/v1/embeddings`` body."""

    model: str
    texts: tuple[str, ...]
    base64: bool
    """``encoding_format: "base64"`` (else float)."""


def parse_embeddings(body: Mapping[str, Any], known: Callable[[str], bool]) -> EmbeddingsRequest:
    """Check one body; ``known(model)`` says whether the model exists (else a 404).

    :raises HttpError: a field missing, wrong or unsupported (400), an unknown model (404).
    """
    for name in body:
        if name not in _FIELDS:
            raise HttpError(
                400,
                f"Unrecognized request argument supplied: {clip(name)}",
                param=clip(name),
                code="unknown_parameter",
            )
    model = body.get("model")
    if not isinstance(model, str):
        raise HttpError(400, "model is required (a string)", param="model")
    if not known(model):
        raise model_not_found(model)
    if body.get("dimensions") is not None:
        raise HttpError(
            400,
            "dimensions is not supported by this server: a vector keeps its model's length",
            param="dimensions",
            code="unsupported_parameter",
        )
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64", None):
        raise HttpError(400, 'encoding_format must be "float" or "base64"', param="encoding_format")
    return EmbeddingsRequest(model, _texts(body.get("input")), encoding == "base64")


def _texts(value: Any) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or len(texts) > MAX_INPUTS:
        raise HttpError(
            400, f"input must be a string or an array of 1 to {MAX_INPUTS} strings",
            param="input",
        )  # fmt: skip
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise HttpError(
                400,
                "input must be text: token arrays are not supported (the node tokenizes "
                "with its model's own tokenizer)",
                param="input",
            )
        if not text or len(text) > MAX_CHARACTERS:
            raise HttpError(
                400, f"input[{i}] must have 1 to {MAX_CHARACTERS} characters", param="input"
            )
        checked_text(text, "input")
    return tuple(texts)


def chunks(texts: Sequence[str]) -> list[tuple[str, ...]]:
    """The texts of each EMBED_REQ, in order."""
    return [tuple(texts[i : i + PER_REQUEST]) for i in range(0, len(texts), PER_REQUEST)]


def embeddings_body(request: EmbeddingsRequest, parts: Sequence[Embedded]) -> dict[str, Any]:
    """The answer: one ``embedding`` per input, in order (``parts``: each chunk's answer)."""
    data: list[dict[str, Any]] = []
    for part in parts:
        row = part.dim * 4
        for start in range(0, len(part.vectors), row):
            vector = part.vectors[start : start + row]
            shown: Any = (
                base64.b64encode(vector).decode("ascii")
                if request.base64
                else list(struct.unpack(f"<{part.dim}f", vector))
            )
            data.append({"object": "embedding", "index": len(data), "embedding": shown})
    tokens = sum(part.tokens for part in parts)
    return {
        "object": "list",
        "data": data,
        "model": request.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


__all__ = [
    "MAX_CHARACTERS",
    "MAX_INPUTS",
    "PER_REQUEST",
    "EmbeddingsRequest",
    "chunks",
    "embeddings_body",
    "parse_embeddings",
]
