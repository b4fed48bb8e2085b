"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``,
``/api/show``, ``/api/version``) as a translation onto chat completions and embeddings
(docs/api.md "Ollama's API").

- :func:`translate_chat` and :func:`translate_generate` check an Ollama body and write the chat
  completions body that serves it: ``messages`` (an assistant's ``tool_calls`` given ids, each
  ``tool`` turn answering the oldest call not yet answered), ``system`` and ``prompt``
  (``/api/generate``), ``tools`` (chat's shape already), ``format`` (``"json"`` to
  ``json_object``, a JSON Schema to ``json_schema``), ``options`` (``num_predict`` to
  ``max_tokens``, ``repeat_penalty`` to ``repetition_penalty``, ``stop``, ``seed`` and the
  sampler's controls; an option for the runtime, such as ``num_ctx``, is ignored, as Ollama
  ignores what a model does not use) and ``stream``, which is true unless the body says false.
- :class:`OllamaBuilder` builds what the answer says: the NDJSON lines of a stream (a line
  per piece of text, a line per whole tool call, then the ``done`` line with
  ``done_reason`` and the counts) or the one body, in ``/api/chat``'s shape (``message``) or
  ``/api/generate``'s (``response``).
- :func:`translate_embed` and :func:`embed_body`: ``/api/embed`` onto ``/v1/embeddings``.
- :func:`ollama_error` writes any error the head answers in Ollama's shape (``{"error":
  message}``); :func:`tags` and :func:`show` are the model listings.

This module is pure: it must never tokenize, touch the network, the reactor or a thread, and
never raise anything but :class:`~sfnode.runtime.http_guard.HttpError` for any JSON value.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sfnode.head.api.messages import arguments_object
from sfnode.head.api.schema import checked_text
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallEvent, CallOpened, Content
from sfnode.runtime.http_guard import HttpError, clip

OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repeat_penalty": "repetition_penalty",
}  # fmt: skip
"""Ollama's ``options`` that mean what a chat field means (``num_predict`` is ``max_tokens``)."""
_COMMON = frozenset({"model", "format", "options", "stream", "keep_alive", "think"})
_CHAT = frozenset({"messages", "tools", *_COMMON})
_EMBED = frozenset({"model", "input", "truncate", "options", "keep_alive", "dimensions"})
_GENERATE = frozenset({"prompt", "system", "raw", "images", "suffix", "template", "context",
                       *_COMMON})  # fmt: skip


class OllamaError(HttpError):
    """An error answered in Ollama's shape: ``{"error": message}``."""

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


def ollama_error(error: HttpError) -> OllamaError:
    """``error`` (the same status, message and headers) in Ollama's shape."""
    if isinstance(error, OllamaError):
        return error
    return OllamaError(
        error.status, error.message, kind=error.kind, param=error.param, code=error.code,
        outcome=error.outcome, headers=error.headers,
    )  # fmt: skip


def timestamp(seconds: float) -> str:
    """``created_at`` as Ollama writes it (RFC 3339, UTC)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------------------------
# Requests


def translate_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body of an ``/api/chat`` body (see the module's docstring).

    :raises HttpError: a field missing, wrong or unsupported (400).
    """
    chat = _common(body, _CHAT)
    chat["messages"] = _messages(body.get("messages", []))
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise HttpError(400, "tools must be an array", param="tools")
        chat["tools"] = tools
    return chat


def translate_generate(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body of an ``/api/generate`` body: ``system`` and ``prompt`` as a
    system and a user turn (``raw`` prompts, ``images``, ``suffix``, ``template`` and
    ``context`` are refused: the head renders with the model's own chat template).

    :raises HttpError: a field missing, wrong or unsupported (400).
    """
    chat = _common(body, _GENERATE)
    for name in ("raw", "images", "suffix", "template", "context"):
        if body.get(name):
            raise HttpError(
                400, f"{name} is not supported by this server (/v1/completions takes a raw "
                "prompt)", param=name,
            )  # fmt: skip
    prompt, system = body.get("prompt", ""), body.get("system")
    if not isinstance(prompt, str) or not isinstance(system, str | None):
        raise HttpError(400, "prompt and system must be strings", param="prompt")
    turns = [{"role": "system", "content": checked_text(system, "system")}] if system else []
    chat["messages"] = [*turns, {"role": "user", "content": checked_text(prompt, "prompt")}]
    return chat


def translate_embed(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/embeddings`` body of an ``/api/embed`` body (``input`` a string or strings;
    ``truncate``, ``options`` and ``keep_alive`` accepted and ignored: a node cuts a text
    to its model's longest input, as sentence-transformers does).

    :raises HttpError: an unknown field (400).
    """
    for name in body:
        if name not in _EMBED:
            raise HttpError(400, f"unknown field: {clip(str(name))}", param=clip(str(name)))
    return {k: body[k] for k in ("model", "input", "dimensions") if k in body}


def embed_body(model: str, vectors: list[list[float]], tokens: int) -> dict[str, Any]:
    """``/api/embed``'s answer: the vectors in order, the tokens counted."""
    return {"model": model, "embeddings": vectors, "total_duration": 0, "load_duration": 0,
            "prompt_eval_count": tokens}  # fmt: skip


def _common(body: Mapping[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """What ``/api/chat`` and ``/api/generate`` share: the model, ``format``, ``options``,
    ``stream`` (true unless false), ``think`` (off only)."""
    for name in body:
        if name not in known:
            raise HttpError(400, f"unknown field: {clip(str(name))}", param=clip(str(name)))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError(400, "model is required", param="model")
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise HttpError(400, "stream must be a boolean", param="stream")
    if body.get("think") not in (None, False):
        raise HttpError(400, f"{clip(model)} does not support thinking", param="think")
    chat: dict[str, Any] = {"model": model, "stream": stream, **_options(body.get("options"))}
    response_format = _format(body.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _options(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise HttpError(400, "options must be an object", param="options")
    chat = {OPTIONS[k]: v for k, v in options.items() if k in OPTIONS}
    predict = options.get("num_predict")
    if predict is not None and not (isinstance(predict, int) and predict < 0):
        chat["max_tokens"] = predict  # -1 (or -2): as many as the window holds
    return chat


def _format(value: Any) -> dict[str, Any] | None:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise HttpError(400, 'format must be "json" or a JSON Schema', param="format")


def _messages(value: Any) -> list[dict[str, Any]]:
    """Ollama's turns as chat's: its calls carry no ids, so each gets one, and each ``tool``
    turn answers the oldest call not answered yet."""
    if not isinstance(value, list):
        raise HttpError(400, "messages must be an array", param="messages")
    out: list[dict[str, Any]] = []
    waiting: deque[str] = deque()
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise HttpError(400, f"{where} must be an object", param=where)
        role, content = message.get("role"), message.get("content", "")
        if role not in ("system", "user", "assistant", "tool"):
            raise HttpError(400, f"{where}.role must be system, user, assistant or tool",
                            param=f"{where}.role")  # fmt: skip
        if not isinstance(content, str):
            raise HttpError(400, f"{where}.content must be a string", param=f"{where}.content")
        if message.get("images"):
            raise HttpError(400, f"{where}.images: this model takes no images",
                            param=f"{where}.images")  # fmt: skip
        turn: dict[str, Any] = {"role": role, "content": checked_text(content, where)}
        if role == "assistant" and message.get("tool_calls"):
            turn["tool_calls"] = _calls(message["tool_calls"], f"call_{i}", where)
            waiting.extend(call["id"] for call in turn["tool_calls"])
        elif role == "tool":
            turn["tool_call_id"] = waiting.popleft() if waiting else f"call_{i}"
        out.append(turn)
    return out


def _calls(value: Any, prefix: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise HttpError(400, f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str):
            raise HttpError(400, f"{where}.tool_calls[{j}] needs function.name",
                            param=f"{where}.tool_calls")  # fmt: skip
        arguments = function.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"{prefix}_{j}", "type": "function",
                      "function": {"name": name, "arguments": text}})  # fmt: skip
    return calls


# --------------------------------------------------------------------------------------------
# Answers


@dataclass
class OllamaBuilder:
    """One answer's text and calls, built from the call splitter's events: its NDJSON lines
    or its whole body (``chat``: ``/api/chat``'s ``message``, else ``/api/generate``'s
    ``response``)."""

    model: str
    created_at: str
    chat: bool
    text: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    """Whole calls, in Ollama's shape (``{"function": {"name", "arguments": {...}}}``)."""
    _open: dict[int, tuple[str, list[str]]] = field(default_factory=dict)

    def _line(self, content: str, calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": self.created_at}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = list(calls)
            line["message"] = message
        else:
            line["response"] = content
        line["done"] = False
        return line

    def add(self, events: Sequence[CallEvent]) -> list[dict[str, Any]]:
        """Take the splitter's ``events``; the lines they make (a call's when it is whole)."""
        out = []
        for shown in events:
            if isinstance(shown, Content) and shown.text:
                self.text.append(shown.text)
                out.append(self._line(shown.text))
            elif isinstance(shown, CallOpened):
                self._open[shown.index] = (shown.name, [])
            elif isinstance(shown, ArgumentsDelta):
                self._open[shown.index][1].append(shown.fragment)
            elif isinstance(shown, CallDone):
                name, fragments = self._open.pop(shown.index)
                arguments = arguments_object("".join(fragments))
                if arguments is not None:
                    call = {"function": {"name": name, "arguments": arguments}}
                    self.calls.append(call)
                    out.append(self._line("", [call]))
        return out

    def done(self, reason: str, counts: Mapping[str, int]) -> dict[str, Any]:
        """The stream's last line (``counts``: the token counts and durations)."""
        return {**self._line(""), "done": True, "done_reason": reason, **counts}

    def whole(self, reason: str, counts: Mapping[str, int]) -> dict[str, Any]:
        """The non-streamed body: every piece of text and every whole call."""
        body = {**self._line("".join(self.text), self.calls), "done": True}
        return {**body, "done_reason": reason, **counts}


def ndjson(line: Mapping[str, Any]) -> bytes:
    """One line of an NDJSON stream."""
    return json.dumps(line).encode() + b"\n"


def tags(models: Sequence[tuple[str, bool]], modified: str) -> dict[str, Any]:
    """``/api/tags``: every served model (``(name, embeds)``); sizes and digests are a
    node's business, shown as 0 and empty."""
    return {"models": [{"name": name, "model": name, "modified_at": modified, "size": 0,
                        "digest": "", "details": _details(embeds)}
                       for name, embeds in models]}  # fmt: skip


def show(name: str, window: int, embeds: bool) -> dict[str, Any]:
    """``/api/show`` of a served model: its details, its window as ``model_info``, and what it
    can do (``completion`` and ``tools``, or ``embedding``)."""
    return {
        "modelfile": "", "parameters": "", "template": "", "details": _details(embeds),
        "model_info": {"general.context_length": window or None},
        "capabilities": ["embedding"] if embeds else ["completion", "tools"],
    }  # fmt: skip


def _details(embeds: bool) -> dict[str, Any]:
    return {"parent_model": "", "format": "", "family": "", "families": None,
            "parameter_size": "", "quantization_level": "",
            "embedding_only": embeds}  # fmt: skip


def model_not_found(name: str) -> OllamaError:
    return OllamaError(404, f"model '{clip(name)}' not found", param="model",
                       code="model_not_found", outcome="not_found")  # fmt: skip


__all__ = [
    "OPTIONS",
    "OllamaBuilder",
    "OllamaError",
    "embed_body",
    "model_not_found",
    "ndjson",
    "ollama_error",
    "show",
    "tags",
    "timestamp",
    "translate_chat",
    "translate_embed",
    "translate_generate",
]
