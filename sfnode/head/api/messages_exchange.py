"""One ``/v1/messages`` request on the head: the chat exchange, translated in and answered as
Anthropic's Messages API (docs/api.md "/v1/messages").

:class:`MessagesExchange` is a :class:`~sfnode.head.api.translated.TranslatedExchange`: a chat
completion whose body :func:`sfnode.head.api.messages.translate` wrote (on a worker), whose
:class:`MessagesWriter` answers a ``message`` object or its stream of events
(:class:`~sfnode.head.api.messages.MessageBuilder`) instead of chat's bodies and chunks, and
whose errors are written in Anthropic's shape.

This module must never decide anything the chat exchange decides (placement, back-pressure,
budgets, errors and their statuses, metrics: those stay in :mod:`sfnode.head.api.exchange`), and
never write to a request once the exchange is done or gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sfnode.head.api.exchange import Host, Prepared
from sfnode.head.api.messages import (
    STOP_REASONS,
    MessageBuilder,
    anthropic_error,
    event_bytes,
    new_message_id,
    translate,
)
from sfnode.head.api.translated import BuilderWriter, TranslatedExchange
from sfnode.runtime.http_guard import HttpError


class MessagesExchange(TranslatedExchange):
    """One ``/v1/messages`` request (see the module's docstring)."""

    def __init__(self, api: Host, request: Any) -> None:
        super().__init__(api, request, chat=True)
        self.ident = new_message_id()

    def translate(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return translate(body)

    def shaped(self, error: HttpError) -> HttpError:
        return anthropic_error(error)

    def _place(self, prepared: Prepared) -> None:
        self.writer = MessagesWriter(self, MessageBuilder(self.ident, prepared.request.model))
        super()._place(prepared)


class MessagesWriter(BuilderWriter[MessagesExchange, MessageBuilder]):
    """A :class:`~sfnode.head.api.exchange.Writer` of the Messages API's shapes: every piece of
    output goes through the builder (streamed or not), the stream as its named events."""

    def encode(self, piece: Mapping[str, Any]) -> bytes:
        return event_bytes(piece)

    def opened(self) -> None:
        self._write(self.builder.started(len(self.exchange.prompt)))

    def _stop(self) -> tuple[str, str | None]:
        """The answer's ``stop_reason`` and ``stop_sequence``."""
        choice = self.exchange.choices[0]
        if choice.stop.matched is not None:
            return "stop_sequence", choice.stop.matched
        return STOP_REASONS.get(choice.finish or "stop", "end_turn"), None

    def closed(self, completion_tokens: int) -> None:
        self._write(self.builder.finished(*self._stop(), completion_tokens))

    def whole(self, completion_tokens: int) -> Any:
        usage = {"input_tokens": len(self.exchange.prompt), "output_tokens": completion_tokens}
        return self.builder.whole(*self._stop(), usage)

    def failed(self, error: HttpError) -> None:
        self._write([anthropic_error(error).body()])


__all__ = ["MessagesExchange", "MessagesWriter"]
