"""Anthropic's Messages API (``POST /v1/messages``) as a translation onto chat completions
(docs/api.md "/v1/messages").

- :func:`translate` checks a Messages request body and writes the chat completions body that
  serves it: ``system`` to a system turn, each message's content blocks to chat's turns
  (``text``; an assistant's ``tool_use`` blocks to ``tool_calls``; a user's ``tool_result``
  blocks to ``tool`` turns), ``tools`` (``input_schema``) to function tools, ``tool_choice``
  (``auto``, ``any``, ``tool``, ``none``, ``disable_parallel_tool_use``) to chat's,
  ``stop_sequences`` to ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and
  ``stream`` mean what they mean on chat.
- :class:`MessageBuilder` builds what the answer says: the ``message`` object (``text`` and
  ``tool_use`` content blocks, ``stop_reason``, ``usage``) or its stream of events in the
  documented order: ``message_start``; per block ``content_block_start``,
  ``content_block_delta`` (``text_delta`` or ``input_json_delta``) ..., ``content_block_stop``;
  then ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``) and
  ``message_stop``.
- :func:`anthropic_error` writes any error the head answers in Anthropic's shape
  (``{"type": "error", "error": {"type", "message"}}``, the type named by the status).

This module is pure: it must never tokenize, touch the network, the reactor or a thread, and
never raise anything but :class:`~sfnode.runtime.http_guard.HttpError` for any JSON value.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sfnode.head.api.schema import checked_text, tool_array
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallEvent, CallOpened, Content
from sfnode.runtime.http_guard import HttpError, clip

PASSED = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "stream"})
"""Fields that mean on ``/v1/messages`` what they mean on chat completions."""
IGNORED = frozenset({"metadata", "service_tier", "cache_control"})
"""Accepted and ignored."""
_KNOWN = frozenset(
    {"messages", "system", "tools", "tool_choice", "stop_sequences", "thinking", *PASSED,
     *IGNORED}
)  # fmt: skip
MAX_STOP_SEQUENCES = 4
"""As many stop strings as chat completions take."""

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
"""Anthropic's ``stop_reason`` of a chat ``finish_reason`` (a stop sequence that matched is
``stop_sequence``)."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicError(HttpError):
    """An error answered in Anthropic's shape: ``{"type": "error", "error": {"type",
    "message"}}``, the type named by the HTTP status (any other 4xx is an
    ``invalid_request_error``, any other 5xx an ``api_error``)."""

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def anthropic_error(error: HttpError) -> AnthropicError:
    """``error`` (the same status, message and headers) in Anthropic's shape."""
    if isinstance(error, AnthropicError):
        return error
    return AnthropicError(
        error.status,
        error.message,
        kind=error.kind,
        param=error.param,
        code=error.code,
        outcome=error.outcome,
        headers=error.headers,
    )


def new_message_id() -> str:
    """A message's id, as Anthropic writes them (``msg_`` and 24 characters)."""
    return "msg_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------------------------
# Requests


def translate(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body of a Messages request (see the module's docstring).

    :raises HttpError: a field missing, wrong or unsupported (400).
    """
    _check_fields(body)
    if "max_tokens" not in body:
        raise HttpError(400, "max_tokens: Field required", param="max_tokens")
    chat: dict[str, Any] = {k: v for k, v in body.items() if k in PASSED}
    chat["messages"] = [*_system(body.get("system")), *_messages(body.get("messages"))]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat.update(_tool_choice(body.get("tool_choice")))
    stops = body.get("stop_sequences")
    if stops is not None:
        if (
            not isinstance(stops, list)
            or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) for s in stops)
        ):
            raise HttpError(
                400,
                f"stop_sequences must be an array of at most {MAX_STOP_SEQUENCES} strings",
                param="stop_sequences",
            )
        if stops:
            chat["stop"] = stops
    return chat


def _check_fields(body: Mapping[str, Any]) -> None:
    """Refuse a field this server does not know, and thinking that is not disabled."""
    for name in body:
        if name not in _KNOWN:
            raise HttpError(400, f"{clip(name)}: Extra inputs are not permitted", param=clip(name))
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") == "disabled"
    ):
        raise HttpError(400, "thinking is not supported by this server", param="thinking")


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    text = _text(value, "system")
    return [{"role": "system", "content": text}] if text else []


def _text(value: Any, where: str) -> str:
    """A string, or an array of ``text`` blocks, as one text."""
    if isinstance(value, str):
        return checked_text(value, where)
    if not isinstance(value, list):
        raise HttpError(400, f"{where} must be a string or an array of text blocks", param=where)
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise HttpError(
                400,
                f"{where}[{j}]: only text blocks are supported here (no images or documents)",
                param=f"{where}[{j}]",
            )
        parts.append(_string(block, "text", f"{where}[{j}]"))
    return "".join(parts)


def _string(block: Mapping[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise HttpError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return checked_text(value, f"{where}.{key}")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise HttpError(400, "messages must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise HttpError(400, f"{where}.role must be user or assistant", param=f"{where}.role")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise HttpError(
                400, f"{where}.content must be a string or an array of content blocks",
                param=f"{where}.content",
            )  # fmt: skip
        if message["role"] == "user":
            out.extend(_user_turns(blocks, f"{where}.content"))
        else:
            out.append(_assistant_turn(blocks, f"{where}.content"))
    if out[-1]["role"] == "assistant":
        raise HttpError(
            400,
            "a last assistant turn (a prefill to continue) is not supported by this server",
            param=f"messages[{len(value) - 1}]",
        )
    return out


def _user_turns(blocks: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """A user message's blocks: its ``tool_result`` blocks as ``tool`` turns, then its text
    as a user turn."""
    turns: list[dict[str, Any]] = []
    text: list[str] = []
    for at, kind, block in _typed(blocks, where):
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "tool_result":
            assert isinstance(block, dict)
            result = block.get("content", "")
            output = _text(result, f"{at}.content")
            if block.get("is_error"):
                output = "Error: " + output
            call_id = _string(block, "tool_use_id", at)
            turns.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise _unsupported_block(kind, at, "text and tool_result")
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


def _assistant_turn(blocks: Sequence[Any], where: str) -> dict[str, Any]:
    """An assistant message's blocks: its text, and its ``tool_use`` blocks as calls."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, kind, block in _typed(blocks, where):
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "tool_use":
            assert isinstance(block, dict)
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise HttpError(400, f"{at}.input must be an object", param=f"{at}.input")
            function = {"name": _string(block, "name", at), "arguments": json.dumps(arguments)}
            calls.append({"id": _string(block, "id", at), "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a model's thinking sent back: nothing to render
        else:
            raise _unsupported_block(kind, at, "text, tool_use and thinking")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["content"] = turn["content"] or None
        turn["tool_calls"] = calls
    return turn


def _typed(blocks: Sequence[Any], where: str) -> Iterator[tuple[str, Any, Any]]:
    """Each block with where it stands (``{where}[j]``) and its ``type`` (None for a block
    that is not an object)."""
    for j, block in enumerate(blocks):
        yield f"{where}[{j}]", block.get("type") if isinstance(block, dict) else None, block


def _unsupported_block(kind: Any, where: str, supported: str) -> HttpError:
    named = clip(str(kind)) if isinstance(kind, str) else "a block without a type"
    return HttpError(
        400, f"{where}: {named} is not supported here ({supported} blocks are)", param=where
    )


def _tools(value: Any) -> list[dict[str, Any]]:
    return tool_array(value, _chat_tool)


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """Chat's tool for Anthropic's client tool ``tools[i]``."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise HttpError(
            400,
            f"tools[{i}]: only client tools (name, description, input_schema) are "
            "supported, no server tools",
            param=f"tools[{i}]",
        )
    function: dict[str, Any] = {"name": tool.get("name")}
    if "description" in tool:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema", {"type": "object"})
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> dict[str, Any]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` of Anthropic's ``tool_choice``."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    chat: dict[str, Any] = {}
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(value, dict) and isinstance(value.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        raise HttpError(
            400,
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
            '{"type": "tool", "name": ...}',
            param="tool_choice",
        )
    assert isinstance(value, dict)
    if value.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False
    return chat


# --------------------------------------------------------------------------------------------
# Answers


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes a ``tool_use`` block's (``toolu_`` and the rest of the
    head's ``call_`` id)."""
    return "toolu_" + call_id.removeprefix("call_")


@dataclass
class _Block:
    kind: str
    """``text`` or ``tool_use``."""
    text: str = ""
    """The text, or the tool's input as JSON text so far."""
    id: str = ""
    name: str = ""
    done: bool = False
    """A tool_use block's input is whole."""


class MessageBuilder:
    """One answer's content blocks, built from the call splitter's events; its stream's
    events or its whole ``message`` object."""

    def __init__(self, ident: str, model: str) -> None:
        self.ident = ident
        self.model = model
        self.blocks: list[_Block] = []
        self._open = False
        """The last block is open in the stream (its content_block_stop is not out)."""

    def _message(
        self, stop: tuple[str | None, str | None], usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def started(self, input_tokens: int) -> list[dict[str, Any]]:
        """The stream's first event."""
        usage = {"input_tokens": input_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": self._message((None, None), usage)}]

    def add(self, events: Sequence[CallEvent]) -> list[dict[str, Any]]:
        """Take the splitter's ``events``; the stream events they make."""
        out: list[dict[str, Any]] = []
        for shown in events:
            if isinstance(shown, Content):
                if not self.blocks or self.blocks[-1].kind != "text" or not self._open:
                    out += self._start(_Block("text"), {"type": "text", "text": ""})
                self.blocks[-1].text += shown.text
                out.append(self._delta({"type": "text_delta", "text": shown.text}))
            elif isinstance(shown, CallOpened):
                block = _Block("tool_use", id=tool_use_id(shown.id), name=shown.name)
                start = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
                out += self._start(block, start)
            elif isinstance(shown, ArgumentsDelta):
                self.blocks[-1].text += shown.fragment
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": shown.fragment})
                )
            elif isinstance(shown, CallDone):
                self.blocks[-1].done = True
                out += self._stop()
        return out

    def _start(self, block: _Block, shown: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._stop()
        self.blocks.append(block)
        self._open = True
        index = len(self.blocks) - 1
        out.append({"type": "content_block_start", "index": index, "content_block": shown})
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _stop(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def finished(
        self, stop_reason: str, stop_sequence: str | None, output_tokens: int
    ) -> list[dict[str, Any]]:
        """The stream's last events."""
        return [
            *self._stop(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": output_tokens},
            },
            {"type": "message_stop"},
        ]

    def whole(
        self, stop_reason: str, stop_sequence: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        """The ``message`` object: its text blocks and its whole ``tool_use`` blocks (a call
        the budget cut has no input that parses, and is left out, as a call whose arguments
        are no JSON object would be)."""
        message = self._message((stop_reason, stop_sequence), usage)
        for block in self.blocks:
            if block.kind == "text" and block.text:
                message["content"].append({"type": "text", "text": block.text})
            elif block.kind == "tool_use" and block.done:
                arguments = arguments_object(block.text)
                if arguments is not None:
                    message["content"].append(
                        {"type": "tool_use", "id": block.id, "name": block.name,
                         "input": arguments}
                    )  # fmt: skip
        return message


def arguments_object(text: str) -> dict[str, Any] | None:
    """A call's arguments as the object ``input`` needs; None for text that is no JSON
    object (a grammar-held call always is one)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def event_bytes(event: Mapping[str, Any]) -> bytes:
    """One server-sent event of a Messages stream (named by its type)."""
    return b"event: %s\ndata: %s\n\n" % (str(event["type"]).encode(), json.dumps(event).encode())


__all__ = [
    "IGNORED",
    "MAX_STOP_SEQUENCES",
    "PASSED",
    "STOP_REASONS",
    "AnthropicError",
    "MessageBuilder",
    "anthropic_error",
    "arguments_object",
    "event_bytes",
    "new_message_id",
    "tool_use_id",
    "translate",
]
