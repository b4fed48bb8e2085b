"""The OpenAI response bodies of the head: what the HTTP API answers, built by pure functions.

The mirror of :mod:`sfnode.head.api.schema` (which parses requests): a chat completion, a text
completion, the chunks of a stream (the role chunk, text deltas, a choice's finish, the usage
chunk, ``data: [DONE]``), usage, errors, the model list and the health check, each built here and
nowhere else, as plain JSON-ready values or the bytes of one server-sent event.

This module is pure: it must never touch a request, the network, the reactor or a clock (the
caller passes ``created``), and never build a shape OpenAI's clients do not parse.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"
"""The last event of every stream (OpenAI's end marker)."""


def new_ident(chat: bool) -> str:
    """A fresh completion id: ``chatcmpl-...`` for chat, ``cmpl-...`` for text completions."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Reply:
    """What every body and chunk of one completion shares."""

    ident: str
    created: int
    """Unix seconds when the request came in."""
    model: str
    """The model name the client asked for."""
    chat: bool
    """``/v1/chat/completions`` (else ``/v1/completions``)."""

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def body_object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


@dataclass(frozen=True, slots=True)
class ChoiceBody:
    """One choice of a finished, unstreamed completion."""

    index: int
    text: str
    finish: str | None
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """The calls read out of the text (then ``text`` is what came before them, and ``None``
    as content when empty); None: the request had no tools that may be called."""
    closed: bool = False
    """The node closed the constrained output within its budget (:data:`CLOSED`)."""


CLOSED = {"closed": True}
"""A choice's ``finish_details`` when the node closed its constrained output early, within its
budget (docs/api.md "Budgets"); a choice that ended otherwise has no ``finish_details``."""


def json_bytes(body: Any) -> bytes:
    """``body`` as JSON bytes."""
    return json.dumps(body).encode()


def event(body: Any) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chunk(
    reply: Reply,
    index: int,
    delta: dict[str, Any],
    text: str,
    logprobs: dict[str, Any] | None,
    finish: str | None,
    closed: bool = False,
) -> dict[str, Any]:
    """One streamed choice: ``delta`` for chat, ``text`` for text completions."""
    entry: dict[str, Any] = {"index": index}
    if reply.chat:
        entry["delta"] = delta
    else:
        entry["text"] = text
    entry["logprobs"] = logprobs
    entry["finish_reason"] = finish
    if closed:
        entry["finish_details"] = CLOSED
    return {
        "id": reply.ident,
        "object": reply.chunk_object,
        "created": reply.created,
        "model": reply.model,
        "choices": [entry],
    }


def delta_chunk(
    reply: Reply, index: int, text: str, *, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A streamed piece of choice ``index``: ``{"delta": {"content": text}}`` for chat,
    ``{"text": text}`` for text completions, with the logprobs of its tokens."""
    return _chunk(reply, index, {"content": text}, text, logprobs, None)


def calls_chunk(
    reply: Reply, index: int, calls: list[dict[str, Any]], *, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A streamed piece of chat choice ``index``'s tool calls: ``{"delta": {"tool_calls":
    calls}}`` (each entry from :func:`sfnode.head.models.tools.call_delta`)."""
    return _chunk(reply, index, {"tool_calls": calls}, "", logprobs, None)


def role_chunk(reply: Reply, index: int) -> dict[str, Any]:
    """The first chunk of a chat choice: the assistant's role and empty content."""
    return _chunk(reply, index, {"role": "assistant", "content": ""}, "", None, None)


def finish_chunk(reply: Reply, index: int, finish: str, *, closed: bool = False) -> dict[str, Any]:
    """The chunk that ends choice ``index``: an empty delta (chat) or text, its
    ``finish_reason``, and ``finish_details`` when its output was ``closed`` early."""
    return _chunk(reply, index, {}, "", None, finish, closed)


def usage_chunk(reply: Reply, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
    return {
        "id": reply.ident,
        "object": reply.chunk_object,
        "created": reply.created,
        "model": reply.model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion(
    reply: Reply, choices: Sequence[ChoiceBody], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A whole, unstreamed completion (``chat.completion`` or ``text_completion``)."""
    entries: list[dict[str, Any]] = []
    for choice in choices:
        if reply.chat:
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                message["content"] = choice.text or None
                message["tool_calls"] = choice.tool_calls
            entry: dict[str, Any] = {"index": choice.index, "message": message}
        else:
            entry = {"index": choice.index, "text": choice.text}
        entry["logprobs"] = choice.logprobs
        entry["finish_reason"] = choice.finish
        if choice.closed:
            entry["finish_details"] = CLOSED
        entries.append(entry)
    return {
        "id": reply.ident,
        "object": reply.body_object,
        "created": reply.created,
        "model": reply.model,
        "choices": entries,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def model_entry(name: str, window: int, nodes: int, *, embeds: bool = False) -> dict[str, Any]:
    """One entry of ``/v1/models`` (``window`` 0: unknown, shown as null; ``nodes``: how many
    live nodes serve it; ``embeds``: an embedding model, served by ``/v1/embeddings`` only)."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "sfnode",
        "context_length": window or None,
        "nodes": nodes,
        "capabilities": {
            "chat": not embeds,
            "completions": not embeds,
            "embeddings": embeds,
            "vision": False,
        },
    }


def model_list(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": list(entries)}


def health(
    state: str,
    *,
    nodes: int,
    lanes_active: int,
    lanes_total: int,
    queued: int,
    requests: int,
) -> dict[str, Any]:
    """The body of ``/healthz`` (``state``: ok, busy, unavailable or draining)."""
    return {
        "status": state,
        "nodes": nodes,
        "lanes_active": lanes_active,
        "lanes_total": lanes_total,
        "queued": queued,
        "requests": requests,
    }


ALIVE = {"status": "alive"}
"""The body of ``/healthz?probe=live``."""

__all__ = [
    "ALIVE",
    "CLOSED",
    "DONE",
    "ChoiceBody",
    "Reply",
    "calls_chunk",
    "completion",
    "delta_chunk",
    "event",
    "finish_chunk",
    "health",
    "json_bytes",
    "model_entry",
    "model_list",
    "new_ident",
    "role_chunk",
    "usage",
    "usage_chunk",
]
