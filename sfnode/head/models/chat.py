"""A chat conversation as the head's models see it: the messages a chat template renders and
the tool calls of an assistant's history.

The API's schema builds these from a checked request body; the renderer and the tool-call
code read them.  Plain frozen values: this module must never parse JSON, tokenize or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChatToolCall:
    """A call an assistant message of the history made (OpenAI's ``tool_calls[]``)."""

    id: str
    name: str
    arguments: str
    """The arguments' JSON text, as the client sent it."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message as the chat template sees it."""

    role: str
    content: str
    tool_calls: tuple[ChatToolCall, ...] = ()
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """The call a ``tool`` message answers."""

    @property
    def characters(self) -> int:
        return (
            len(self.role)
            + len(self.content)
            + sum(len(c.name) + len(c.arguments) + len(c.id) for c in self.tool_calls)
            + len(self.tool_call_id or "")
        )


__all__ = ["ChatMessage", "ChatToolCall"]
