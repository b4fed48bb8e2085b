"""A request of another API (Anthropic's Messages, Ollama's) served as a chat completion: the
exchange whose body a pure ``translate`` function writes, on the head's workers, and whose
errors are answered in that API's shape.

:class:`TranslatedExchange` parses and translates the body on a worker, in the client's turn,
within ``--template-timeout`` (as ``/v1/responses`` does), then checks and renders the chat body
as the chat exchange does; each subclass names its ``translate``, its error shape and its
writer.  :class:`BuilderWriter` is what those writers (and ``/v1/responses``') share: the
choice's events go through the API's builder, and what it returns is streamed.

This module must never decide anything the chat exchange decides (placement, back-pressure,
budgets, errors and their statuses, metrics: those stay in :mod:`sfnode.head.api.exchange`),
and never parse or translate a body on the reactor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred

from sfnode.head.api.exchange import Exchange, Prepared, RequestChoice, client_of
from sfnode.head.api.responses import translation_timeout
from sfnode.head.api.schema import parse_body
from sfnode.head.fleet.backend import BackendStatus
from sfnode.head.models.tools import CallEvent
from sfnode.runtime.http_guard import HttpError


class TranslatedExchange(Exchange):
    """One request of another API, answered through the chat exchange (see the module's
    docstring)."""

    chat_body: dict[str, Any] | None = None
    """The chat body once translated (an error after it is about the chat body's fields)."""

    def translate(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat completions body of ``body`` (pure; run on a worker)."""
        raise NotImplementedError

    def shaped(self, error: HttpError) -> HttpError:
        """``error`` in this API's shape."""
        return error

    def _prepare_chat(
        self, data: bytes | dict[str, Any], statuses: Mapping[str, BackendStatus]
    ) -> Deferred[Prepared]:
        api = self.api
        seconds = api.template_timeout_s

        def translated() -> dict[str, Any]:
            return self.translate(data if isinstance(data, dict) else parse_body(data))

        chat = api.workers.run(
            translated,
            client_of(self.request),
            budget_s=seconds,
            refusal=lambda: translation_timeout(seconds),
        )

        def prepare(body: dict[str, Any]) -> Deferred[Prepared]:
            self.chat_body = body
            return Exchange._prepare_chat(self, body, statuses)

        return chat.addCallback(prepare)

    def _answer_error(self, error: HttpError) -> None:
        super()._answer_error(self.shaped(error))


def field_renamed(error: HttpError, chat_field: str, own_field: str) -> HttpError:
    """``error`` about the translated chat body's ``chat_field`` (its range, its budget) as
    about the request's own ``own_field``; any other error as it is."""
    if error.param != chat_field:
        return error
    return type(error)(
        error.status,
        error.message.replace(chat_field, own_field),
        kind=error.kind,
        param=own_field,
        code=error.code,
        outcome=error.outcome,
        headers=error.headers,
    )


class Builder(Protocol):
    """What a :class:`BuilderWriter` asks of its API's builder."""

    def add(self, events: Sequence[CallEvent]) -> list[dict[str, Any]]:
        """Take a choice's events; the pieces of output they make (streamed or not)."""


_X = TypeVar("_X", bound=Exchange)
_B = TypeVar("_B", bound=Builder)


@dataclass(eq=False)
class BuilderWriter(Generic[_X, _B]):
    """The part of a :class:`~sfnode.head.api.exchange.Writer` whose output goes through a
    builder: :meth:`show` gives it the choice's events and streams the pieces it returns, each
    as :meth:`encode` writes it."""

    exchange: _X
    builder: _B

    def encode(self, piece: Mapping[str, Any]) -> bytes:
        """One piece of output as the stream carries it."""
        raise NotImplementedError

    def _write(self, pieces: Iterable[dict[str, Any]]) -> None:
        for piece in pieces:
            self.exchange.stream.send(self.encode(piece))

    def show(self, choice: RequestChoice, events: Sequence[CallEvent], *, streamed: bool) -> None:
        shown = self.builder.add(events)
        if streamed:
            self._write(shown)

    def choice_finished(self, choice: RequestChoice) -> None:
        pass  # the answer's last pieces say it (closed)


__all__ = ["Builder", "BuilderWriter", "TranslatedExchange", "field_renamed"]
