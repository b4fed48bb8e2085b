"""Tool calls on the head: the generic rendering of tools and tool history into a chat, and the
calls read back out of the output, whole or as it streams (docs/api.md "Tools";
docs/protocol.md section 12.3).

- :func:`template_messages` turns the checked messages of a request with tools into what the
  model's chat template renders: as they are (with OpenAI's ``tools`` for the template's jinja
  ``tools`` variable) when the template knows tools, else the **generic rendering**: the tools
  described in the system turn (:func:`sfnode.decoding.constraint.tools_system_text`), an
  assistant's earlier calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  after its text, and each ``role: "tool"`` result as a user turn
  ``<tool_response>\\n...\\n</tool_response>`` (consecutive results in one turn).
- :class:`CallSplitter` reads an output that a tools grammar constrained, piece by piece as it
  is detokenized, into :class:`Content` (text before the first call), :class:`CallOpened`
  (the call's index, id and function name) and :class:`ArgumentsDelta` (fragments of the
  call's ``arguments`` text); the raw tags never come out.  A non-streamed answer is the same
  events gathered (:class:`CallsAnswer`), so the streamed fragments concatenate to the
  non-streamed arguments by construction.

This module is pure: it must never tokenize, touch the network, the reactor or a thread, and
never raise for any output text (text that is no call is content).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sfnode.decoding.constraint import CALL_CLOSE, CALL_OPEN, CALL_SEPARATOR, tools_system_text
from sfnode.head.models.chat import ChatMessage, ChatToolCall

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')
_HEADER_LIMIT = 128
"""Characters after ``<tool_call>`` within which a call's header (its name) must be complete."""


def new_call_id() -> str:
    """A tool call's id, as OpenAI writes them (``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------------------------
# Rendering


def template_messages(
    messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]], knows_tools: bool
) -> tuple[list[ChatMessage], list[Mapping[str, Any]] | None]:
    """What the chat template renders for ``messages`` and ``tools`` (OpenAI's checked
    ``tools`` array): the messages and the tools as they are when the template
    ``knows_tools``, else the generic rendering and no tools."""
    if knows_tools:
        return list(messages), (list(tools) if tools else None)
    if not tools and not any(m.tool_calls or m.role == "tool" for m in messages):
        return list(messages), None
    out: list[ChatMessage] = []
    if tools:
        text = tools_system_text(tools)
        if messages and messages[0].role == "system":
            out.append(ChatMessage("system", messages[0].content + "\n\n" + text))
            messages = messages[1:]
        else:
            out.append(ChatMessage("system", text))
    results: list[str] = []
    for message in messages:
        if message.role == "tool":
            results.append(f"{RESPONSE_OPEN}\n{message.content}\n{RESPONSE_CLOSE}")
            continue
        if results:
            out.append(ChatMessage("user", "\n".join(results)))
            results = []
        if message.tool_calls:
            calls = CALL_SEPARATOR.join(written_call(c) for c in message.tool_calls)
            content = message.content + ("\n" if message.content else "") + calls
            out.append(ChatMessage(message.role, content))
        else:
            out.append(message)
    if results:
        out.append(ChatMessage("user", "\n".join(results)))
    return out, None


def written_call(call: ChatToolCall) -> str:
    """A call as the generic rendering writes it (the grammar's own spelling: one line,
    ``: `` after keys, ``, `` between items)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments  # a client's own history: written as it gave it
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as a chat template that knows tools reads it (Hugging Face's convention:
    ``tool_calls[].function.arguments`` as an object, ``tool_call_id`` on results)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_value(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def masked(message: ChatMessage, mask: Callable[[str], str]) -> ChatMessage:
    """``message`` with ``mask`` applied to every text a client wrote in it."""
    return replace(
        message,
        content=mask(message.content),
        tool_calls=tuple(
            replace(c, arguments=mask(c.arguments), id=mask(c.id)) for c in message.tool_calls
        ),
        tool_call_id=None if message.tool_call_id is None else mask(message.tool_call_id),
    )


def client_texts(message: ChatMessage) -> Iterator[str]:
    """Every text a client wrote in ``message``."""
    yield message.content
    for call in message.tool_calls:
        yield call.arguments
        yield call.id
    if message.tool_call_id is not None:
        yield message.tool_call_id


# --------------------------------------------------------------------------------------------
# Reading calls back


@dataclass(frozen=True, slots=True)
class Content:
    """Text of the answer (before any call)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    """A call starts: its index in the answer, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """The next fragment of call ``index``'s ``arguments`` text."""

    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class CallDone:
    """Call ``index``'s arguments are whole (an output cut short leaves its last call
    without one)."""

    index: int


CallEvent = Content | CallOpened | ArgumentsDelta | CallDone


class CallSplitter:
    """Output text in (as detokenized pieces), :data:`CallEvent`\\ s out.

    Text that may be the start of ``<tool_call>`` is held back until it is known; after the tag,
    the call's header is held until its name is known, then the ``arguments`` object is passed
    through as it comes, its end found by counting brackets outside strings; ``}`` and
    ``</tool_call>`` are swallowed, and a newline and another ``<tool_call>`` open the next
    call.  Anything that turns out not to be a call comes out as content.
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._buffer = ""
        self._mode = "text"
        self._calls = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def calls(self) -> int:
        """Calls opened so far."""
        return self._calls

    def feed(self, text: str) -> list[CallEvent]:
        """The events ``text`` (the next piece of output) completes."""
        self._buffer += text
        events: list[CallEvent] = []
        while self._buffer:
            before = (self._mode, len(self._buffer))
            getattr(self, "_" + self._mode)(events)
            if (self._mode, len(self._buffer)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[CallEvent]:
        """The output ended: what is still held back (text that was not a call after all;
        an unfinished call's tail is dropped)."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "text" and rest:
            return [Content(rest)]
        if self._mode == "header" and rest:
            return [Content(CALL_OPEN + rest)] if not self._calls else []
        return []

    def _text(self, events: list[CallEvent]) -> None:
        buffer = self._buffer
        start = buffer.find(CALL_OPEN)
        if start >= 0:
            if start:
                events.append(Content(buffer[:start]))
            self._buffer = buffer[start + len(CALL_OPEN) :]
            self._mode = "header"
            return
        keep = _partial_suffix(buffer, CALL_OPEN)
        if len(buffer) > keep:
            events.append(Content(buffer[: len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep :]

    def _header(self, events: list[CallEvent]) -> None:
        found = _HEADER.match(self._buffer)
        if found is None:
            if len(self._buffer) > _HEADER_LIMIT or CALL_CLOSE in self._buffer:
                # No call's header: what there is was text after all.
                text = CALL_OPEN + self._buffer
                self._buffer, self._mode = "", "text"
                if not self._calls:
                    events.append(Content(text))
            return
        events.append(CallOpened(self._calls, self._new_id(), found.group(1)))
        self._calls += 1
        self._buffer = self._buffer[found.end() :]
        self._mode = "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False

    def _arguments(self, events: list[CallEvent]) -> None:
        buffer = self._buffer
        end = None
        for i, char in enumerate(buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        fragment = buffer if end is None else buffer[:end]
        if fragment:
            events.append(ArgumentsDelta(self._calls - 1, fragment))
        self._buffer = "" if end is None else buffer[end:]
        if end is not None:
            events.append(CallDone(self._calls - 1))
            self._mode = "closing"

    def _closing(self, events: list[CallEvent]) -> None:
        close = self._buffer.find(CALL_CLOSE)
        if close >= 0:
            self._buffer = self._buffer[close + len(CALL_CLOSE) :]
            self._mode = "between"

    def _between(self, events: list[CallEvent]) -> None:
        opening = CALL_SEPARATOR + CALL_OPEN
        if self._buffer.startswith(opening):
            self._buffer = self._buffer[len(opening) :]
            self._mode = "header"
        elif not opening.startswith(self._buffer):
            self._mode = "text"  # not another call: text (a grammar never writes any here)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class CallsAnswer:
    """The events of one output gathered: its content and its calls (OpenAI's
    ``message.content`` and ``message.tool_calls``)."""

    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    """The calls whose arguments are whole."""

    def add(self, events: Sequence[CallEvent]) -> None:
        for event in events:
            if isinstance(event, Content):
                self.content.append(event.text)
            elif isinstance(event, CallOpened):
                self.calls.append(
                    {
                        "id": event.id,
                        "type": "function",
                        "function": {"name": event.name, "arguments": ""},
                    }
                )
            elif isinstance(event, CallDone):
                self.done.add(event.index)
            else:
                function = self.calls[event.index]["function"]
                function["arguments"] += event.fragment

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def whole_calls(self) -> list[dict[str, Any]]:
        """The calls whose arguments are whole (what a non-streamed answer lists: a call an
        output was cut inside is dropped)."""
        return [call for index, call in enumerate(self.calls) if index in self.done]


def call_delta(event: CallOpened | ArgumentsDelta) -> dict[str, Any]:
    """A streamed chat chunk's ``delta.tool_calls`` entry for ``event`` (OpenAI's shape: the
    first names the call, the rest carry ``arguments`` fragments on the same index)."""
    if isinstance(event, CallOpened):
        return {
            "index": event.index,
            "id": event.id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
    return {"index": event.index, "function": {"arguments": event.fragment}}


__all__ = [
    "RESPONSE_CLOSE",
    "RESPONSE_OPEN",
    "ArgumentsDelta",
    "CallDone",
    "CallEvent",
    "CallOpened",
    "CallSplitter",
    "CallsAnswer",
    "Content",
    "call_delta",
    "client_texts",
    "masked",
    "new_call_id",
    "template_message",
    "template_messages",
    "written_call",
]
