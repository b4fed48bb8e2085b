"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto chat completions, and
the bounded store behind ``previous_response_id`` (docs/api.md "/v1/responses").

- :func:`translate` (on a worker: its cost grows with the input) checks a Responses request
  body and writes the chat completions body that
  serves it (``input`` items to ``messages``, ``instructions`` to a system turn, function tools
  to chat's shape, ``text.format`` to ``response_format``, ``max_output_tokens`` to
  ``max_completion_tokens``), with a stored response's conversation put before the input;
  :class:`ResponsesRequest` keeps what the answer echoes.
- :class:`ResponseBuilder` builds what the answer says: the ``Response`` object, its output
  items (a message with ``output_text``, ``function_call`` items), and the streamed events in
  the documented order (``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` ..., ``response.function_call_arguments.delta`` ...,
  the ``.done`` events, each item done before the next is added, then
  ``response.completed`` or ``response.incomplete``), each numbered by ``sequence_number``.
- :class:`ResponseStore` keeps stored responses (the conversation: the chat messages in, and
  the answer's output as an assistant turn; and the ``Response`` object that
  ``GET /v1/responses/{id}`` answers), each under the API key that made it (only that key
  continues, reads or deletes it: any other gets the 404 an unknown id gets), packed
  (compressed JSON), at most
  ``max_responses`` of them and ``max_bytes`` of memory held, the oldest dropped first; it
  lives in the head's memory only and does not survive a restart.

This module is pure: it must never tokenize, touch the network, the reactor or a thread, never
raise anything but :class:`~sfnode.head.api.schema.HttpError` for any JSON value, and never keep
more than its bounds.
"""

from __future__ import annotations

import json
import sys
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from sfnode.head.api.schema import checked_text, tool_array
from sfnode.head.models.tools import ArgumentsDelta, CallDone, CallEvent, CallOpened, Content
from sfnode.runtime.http_guard import HttpError, clip

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

PASSED = frozenset(
    {
        "model", "temperature", "top_p", "stream", "parallel_tool_calls",
        # Beyond OpenAI's Responses API, as on chat completions:
        "seed", "top_k", "min_p", "logit_bias", "presence_penalty", "frequency_penalty",
        "repetition_penalty",
    }
)  # fmt: skip
"""Fields that mean on ``/v1/responses`` what they mean on chat completions."""
IGNORED = frozenset(
    {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "stream_options"}
)
"""Accepted and ignored (``metadata`` is echoed)."""
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": (None, "disabled", "auto"),
    "include": (None, ()),
    "reasoning": (None,),
    "background": (None, False),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
"""Accepted only with these values (``include`` and ``reasoning`` also as empty containers)."""
_KNOWN = frozenset(
    {
        "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "store",
        "previous_response_id", *PASSED, *IGNORED, *NEUTRAL,
    }
)  # fmt: skip


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked Responses request: the chat body that serves it and what its answer echoes."""

    chat: dict[str, Any]
    """The ``/v1/chat/completions`` body."""
    messages: tuple[dict[str, Any], ...]
    """The conversation sent (a stored response's, then this input), in chat's shape, without
    the instructions: what a later ``previous_response_id`` continues."""
    echo: dict[str, Any]
    """Request fields the ``Response`` object repeats."""
    store: bool = True
    previous_response_id: str | None = None


def translate(body: Mapping[str, Any], found: bytes | None = None) -> ResponsesRequest:
    """The chat body of a Responses request (see the module's docstring); ``found``: what the
    store holds under the requester's key for its ``previous_response_id`` (the caller looks
    it up, :meth:`ResponseStore.get`; None: nothing).

    :raises HttpError: a field wrong or unsupported (400), a ``previous_response_id`` that is
        unknown or stored under another key (the same 404 for both).
    """
    _check_fields(body)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k in PASSED}
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise HttpError(400, "store must be a boolean", param="store")
    previous = body.get("previous_response_id")
    messages = (*_history(previous, found), *_input(body.get("input")))
    instructions = body.get("instructions")
    system: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise HttpError(400, "instructions must be a string", param="instructions")
        system = [{"role": "system", "content": checked_text(instructions, "instructions")}]
    chat["messages"] = [*system, *messages]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    return ResponsesRequest(chat, messages, _echo(body, keep), keep, previous)


def _check_fields(body: Mapping[str, Any]) -> None:
    """Refuse a field this server does not know, or one it does not honour unless it carries
    its neutral value."""
    for name, value in body.items():
        if name in _KNOWN:
            allowed = NEUTRAL.get(name)
            if allowed is not None and not (
                value in allowed or (value in ([], {}) and name in ("include", "reasoning"))
            ):
                raise HttpError(
                    400,
                    f"{name} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
            continue
        raise HttpError(
            400,
            f"Unrecognized request argument supplied: {clip(name)}",
            param=clip(name),
            code="unknown_parameter",
        )


def _history(previous: Any, found: bytes | None) -> tuple[dict[str, Any], ...]:
    """The conversation a ``previous_response_id`` continues (none without one)."""
    if previous is None:
        return ()
    if not isinstance(previous, str):
        raise HttpError(400, "previous_response_id must be a string", param="previous_response_id")
    if found is None:
        raise previous_not_found(previous)
    return unpack(found)[0]


def previous_not_found(previous: str) -> HttpError:
    """The one answer to a ``previous_response_id`` this key cannot continue: unknown, dropped
    by the store's bounds, or another key's (no answer tells them apart)."""
    return HttpError(
        404,
        f"Previous response with id '{clip(previous)}' not found (responses are kept "
        "in the head's memory, only while it runs)",
        param="previous_response_id",
        code="previous_response_not_found",
        outcome="not_found",
    )


def translation_timeout(seconds: float) -> HttpError:
    """The answer to a request whose parsing and translation took more than ``seconds``."""
    return HttpError(
        400,
        f"translating this input took more than {seconds:g} s (--template-timeout, the limit "
        "of a request on this server)",
        param="input",
        code="translation_timeout",
    )


def _echo(body: Mapping[str, Any], keep: bool) -> dict[str, Any]:
    """The request fields the ``Response`` object repeats, defaulted as OpenAI shows them."""
    text = body.get("text")
    return {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": text if isinstance(text, dict) else {"format": {"type": "text"}},
        "previous_response_id": body.get("previous_response_id"),
        "store": keep,
        "truncation": "disabled",
    }


def _input(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user turn; items are messages (``role``
    and ``content``, with or without ``type: "message"``), ``function_call`` items (joined
    into one assistant turn's ``tool_calls``) and ``function_call_output`` items (tool
    turns)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise HttpError(400, "input must be a string or a non-empty array of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise HttpError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise HttpError(
                    400,
                    f"{where}.role must be user, system, developer or assistant",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise HttpError(
                    400, f"{where} needs call_id, name and arguments as strings", param=where
                )
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise HttpError(400, f"{where}.call_id must be a string", param=f"{where}.call_id")
            if not isinstance(output, str):
                output = _content(output, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # a model's reasoning item sent back: nothing to render
        else:
            raise HttpError(
                400,
                f"{where}.type {clip(str(kind))} is not supported (message, function_call and "
                "function_call_output are)",
                param=f"{where}.type",
            )
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError(400, f"{where}.content must be a string or an array of text parts",
                       param=f"{where}.content")  # fmt: skip
    parts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(part.get("text"), str)
        ):
            raise HttpError(
                400,
                f"{where}.content[{j}]: only text parts are supported (no images, audio or files)",
                param=f"{where}.content[{j}]",
            )
        parts.append(part["text"])
    return "".join(parts)


def _tools(value: Any) -> list[dict[str, Any]]:
    return tool_array(value, _chat_tool)


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    """Chat's tool for the Responses API's flat function tool ``tools[i]``."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise HttpError(
            400,
            f"tools[{i}]: only function tools are supported",
            param="tools",
            code="unsupported_parameter",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise HttpError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise HttpError(400, "text must be an object", param="text")
    unknown = set(text) - {"format", "verbosity"}
    if unknown or text.get("verbosity") not in (None, "medium"):
        raise HttpError(400, "text supports format only", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise HttpError(400, "text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise HttpError(
        400, "text.format.type must be text, json_object or json_schema", param="text.format"
    )


# --------------------------------------------------------------------------------------------
# The answer


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass
class _Item:
    """One output item being built."""

    body: dict[str, Any]
    index: int


@dataclass
class ResponseBuilder:
    """One response's output, items and events (see the module's docstring)."""

    ident: str
    created: int
    model: str
    request: ResponsesRequest
    sequence: int = 0
    items: list[_Item] = field(default_factory=list)
    _text: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    """Output indexes of the calls whose arguments are whole."""
    final: dict[str, Any] | None = None
    """The ``Response`` object once the response ended (what ``GET /v1/responses/{id}``
    answers)."""

    def response(
        self, status: str, usage: Mapping[str, int] | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        """The ``Response`` object now (``status`` in_progress, completed or incomplete)."""
        body: dict[str, Any] = {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None if reason is None else {"reason": reason},
            "model": self.model,
            "output": [item.body for item in self.items] if status != "in_progress" else [],
            "usage": None,
            **self.request.echo,
        }
        if usage is not None:
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return body

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def started(self) -> list[dict[str, Any]]:
        """The events that open a stream."""
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def add(self, events: Sequence[CallEvent]) -> list[dict[str, Any]]:
        """The output so far grows by ``events``; the stream events that say so."""
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content):
                if not event.text:
                    continue
                if self._text is None:
                    out += self._open_text()
                item = self._text
                assert item is not None
                item.body["content"][0]["text"] += event.text
                out.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=item.body["id"],
                        output_index=item.index,
                        content_index=0,
                        delta=event.text,
                        logprobs=[],
                    )
                )
            elif isinstance(event, CallOpened):
                out += self._close_text()
                item = _Item(
                    {
                        "type": "function_call",
                        "id": "fc_" + uuid.uuid4().hex[:24],
                        "call_id": event.id,
                        "name": event.name,
                        "arguments": "",
                        "status": "in_progress",
                    },
                    len(self.items),
                )
                self.items.append(item)
                self._calls[event.index] = item
                out.append(
                    self.event(
                        "response.output_item.added",
                        output_index=item.index,
                        item=dict(item.body),
                    )
                )
            elif isinstance(event, CallDone):
                out += self._close_call(event.index, "completed")
            else:
                assert isinstance(event, ArgumentsDelta)
                item = self._calls[event.index]
                item.body["arguments"] += event.fragment
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item.body["id"],
                        output_index=item.index,
                        delta=event.fragment,
                    )
                )
        return out

    def _open_text(self) -> list[dict[str, Any]]:
        item = _Item(
            {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex[:24],
                "status": "in_progress",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": []}],
            },
            len(self.items),
        )
        self.items.append(item)
        self._text = item
        shown = {**item.body, "content": []}
        return [
            self.event("response.output_item.added", output_index=item.index, item=shown),
            self.event(
                "response.content_part.added",
                item_id=item.body["id"],
                output_index=item.index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            ),
        ]

    def _close_text(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._text = self._text, None
        if item is None:
            return []
        item.body["status"] = status
        part = item.body["content"][0]
        ident = item.body["id"]
        return [
            self.event(
                "response.output_text.done",
                item_id=ident,
                output_index=item.index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=ident,
                output_index=item.index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=item.index, item=item.body),
        ]

    def finished(self, usage: Mapping[str, int], reason: str | None = None) -> list[dict[str, Any]]:
        """The events that close every open item and the response (``reason``:
        ``max_output_tokens`` when the output was cut)."""
        status = "completed" if reason is None else "incomplete"
        out = self._close_text(status)
        for index in list(self._calls):
            out += self._close_call(index, status)
        kind = "response.completed" if reason is None else "response.incomplete"
        self.final = self.response(status, usage, reason)
        out.append(self.event(kind, response=self.final))
        return out

    def _close_call(self, index: int, status: str) -> list[dict[str, Any]]:
        """Call ``index``'s last events (its arguments whole when ``status`` is completed):
        each item is done before the next one is added, as OpenAI's streams do."""
        item = self._calls.pop(index)
        if status == "completed":
            self._done.add(item.index)
        item.body["status"] = status
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item.body["id"],
                output_index=item.index,
                arguments=item.body["arguments"],
            ),
            self.event("response.output_item.done", output_index=item.index, item=item.body),
        ]

    def whole(self, usage: Mapping[str, int], reason: str | None = None) -> dict[str, Any]:
        """The non-streamed answer (a call the output was cut inside is dropped)."""
        self.finished(usage, reason)
        self.items = [
            item
            for item in self.items
            if item.body["type"] != "function_call" or item.index in self._done
        ]
        self.final = self.response("completed" if reason is None else "incomplete", usage, reason)
        return self.final

    def conversation(self) -> tuple[dict[str, Any], ...]:
        """The conversation a later ``previous_response_id`` continues: what was sent, then
        this output as an assistant turn."""
        text = "".join(
            item.body["content"][0]["text"] for item in self.items if item.body["type"] == "message"
        )
        calls = [
            {
                "id": item.body["call_id"],
                "type": "function",
                "function": {"name": item.body["name"], "arguments": item.body["arguments"]},
            }
            for item in self.items
            if item.body["type"] == "function_call" and item.index in self._done
        ]
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            turn["tool_calls"] = calls
        return (*self.request.messages, turn)


def event_bytes(event: Mapping[str, Any]) -> bytes:
    """One server-sent event of a Responses stream (named by its type)."""
    return (
        b"event: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + json.dumps(event).encode()
        + b"\n\n"
    )


# --------------------------------------------------------------------------------------------
# The store


Owner = bytes | None
"""Whom a stored response belongs to: the API key that made it (None on a head without
keys)."""
ENTRY_BYTES = 240
"""What one entry of the store holds beside its packed conversation: the key tuple, the id
string, the ordered dictionary's node and the entry tuple (CPython 3.11, measured)."""


def pack(conversation: Sequence[Mapping[str, Any]], response: Mapping[str, Any]) -> bytes:
    """A stored response as the store keeps it: its conversation and its ``Response`` object,
    as JSON, compressed (a worker's job for a large one: it reads every message)."""
    stored = {"conversation": list(conversation), "response": response}
    return zlib.compress(json.dumps(stored).encode(), 6)


def unpack(data: bytes) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """The conversation and the ``Response`` object :func:`pack` packed."""
    stored = json.loads(zlib.decompress(data))
    return tuple(stored["conversation"]), stored["response"]


def response_not_found(ident: str) -> HttpError:
    """The one answer to ``GET`` or ``DELETE /v1/responses/{id}`` of a response this key cannot
    see: unknown, dropped by the store's bounds, deleted, or another key's."""
    return HttpError(
        404,
        f"Response with id '{clip(ident)}' not found (responses are kept in the head's "
        "memory, only while it runs)",
        param="response_id",
        code="response_not_found",
        outcome="not_found",
    )


def deleted(ident: str) -> dict[str, Any]:
    """The answer to a ``DELETE /v1/responses/{id}`` that deleted it."""
    return {"id": ident, "object": "response", "deleted": True}


class ResponseStore:
    """Stored responses' conversations by owner and id, packed (:func:`pack`), bounded: at most
    ``max_responses`` of them and ``max_bytes`` of memory held (the packed bytes as Python
    holds them, and :data:`ENTRY_BYTES` each); the least recently stored or used go first.

    Every lookup is one dictionary probe of ``(owner, id)``: another key's response is not
    found exactly as an unknown id is not, in the same time (no comparison of ids or keys
    whose duration depends on where they differ)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Owner, str], tuple[bytes, int]] = OrderedDict()
        self._pending: dict[tuple[Owner, str], list[Deferred[bytes | None]]] = {}
        """Responses answered whose packing is still under way, and who waits for each."""
        self.held = 0
        """The memory the store holds now, in bytes (``sfhead_responses_stored_bytes``)."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: Owner, ident: str, packed: bytes) -> None:
        """Keep ``packed`` (a conversation :func:`pack` made) as ``owner``'s ``ident``."""
        size = sys.getsizeof(packed) + sys.getsizeof(ident) + ENTRY_BYTES
        if size > self.max_bytes or self.max_responses <= 0:
            return
        entry = (owner, ident)
        old = self._entries.pop(entry, None)
        if old is not None:
            self.held -= old[1]
        self._entries[entry] = (packed, size)
        self.held += size
        while len(self._entries) > self.max_responses or self.held > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.held -= dropped

    def get(self, owner: Owner, ident: str) -> bytes | None:
        """``owner``'s packed conversation ``ident`` (None: unknown, or not ``owner``'s)."""
        entry = (owner, ident)
        found = self._entries.get(entry)
        if found is None:
            return None
        self._entries.move_to_end(entry)
        return found[0]

    def keep(self, owner: Owner, ident: str, packing: Deferred[bytes]) -> None:
        """Keep what ``packing`` will give as ``owner``'s ``ident``: from now on it is found
        (:meth:`found` waits for it), so a client that asks for a response right after its
        answer always finds it.  A failed packing keeps nothing (``packing`` fails on, for
        its caller to log)."""
        entry = (owner, ident)
        self._pending[entry] = []

        def settle(result: bytes | Failure) -> bytes | Failure:
            waiting = self._pending.pop(entry, None)
            if waiting is None:
                return result  # deleted meanwhile: its waiters were answered then
            if isinstance(result, bytes):
                self.put(owner, ident, result)
            for waiter in waiting:
                waiter.callback(self.get(owner, ident))
            return result

        packing.addBoth(settle)

    def found(self, owner: Owner, ident: str) -> Deferred[bytes | None]:
        """:meth:`get`, once a response still being packed is kept."""
        waiting = self._pending.get((owner, ident))
        if waiting is None:
            return succeed(self.get(owner, ident))
        waiter: Deferred[bytes | None] = Deferred()
        waiting.append(waiter)
        return waiter

    def delete(self, owner: Owner, ident: str) -> bool:
        """Forget ``owner``'s ``ident`` (kept, or still being packed); whether it was there
        (another owner's is not)."""
        waiting = self._pending.pop((owner, ident), None)
        for waiter in waiting or ():
            waiter.callback(None)
        found = self._entries.pop((owner, ident), None)
        if found is not None:
            self.held -= found[1]
        return waiting is not None or found is not None

    def families(self) -> list[Metric]:
        """The store's figures for ``/metrics``."""
        return [
            GaugeMetricFamily(
                "sfhead_responses_stored",
                "Responses kept for previous_response_id.",
                value=len(self._entries),
            ),
            GaugeMetricFamily(
                "sfhead_responses_stored_bytes",
                "Memory the stored responses hold (packed conversations and their entries), "
                "bounded by the store's size.",
                value=self.held,
            ),
        ]


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_RESPONSES",
    "ENTRY_BYTES",
    "Owner",
    "ResponseBuilder",
    "ResponseStore",
    "ResponsesRequest",
    "deleted",
    "event_bytes",
    "new_response_id",
    "pack",
    "previous_not_found",
    "response_not_found",
    "translate",
    "translation_timeout",
    "unpack",
]
