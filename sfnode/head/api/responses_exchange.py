"""One ``/v1/responses`` request on the head: the chat exchange, translated in and answered as
OpenAI's Responses API (docs/api.md "/v1/responses").

:class:`ResponsesExchange` is an :class:`~sfnode.head.api.exchange.Exchange` of a chat completion
whose body :func:`sfnode.head.api.responses.translate` wrote, and whose :class:`ResponsesWriter`
answers a ``Response`` object or its stream of events
(:class:`~sfnode.head.api.responses.ResponseBuilder`) instead of chat's bodies and chunks; a
response asked to be stored is put in the API's :class:`~sfnode.head.api.responses.ResponseStore`
when it ends.

This module must never decide anything the chat exchange decides (placement, back-pressure,
errors, metrics: those stay in :mod:`sfnode.head.api.exchange`), never touch the store from a
worker thread, never parse or translate a body on the reactor, and never write to a request
once the exchange is done or gone.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from sfnode.head.api import bodies
from sfnode.head.api.exchange import (
    Exchange,
    Host,
    Prepared,
    answer,
    answer_error,
    client_of,
)
from sfnode.head.api.responses import (
    ResponseBuilder,
    ResponsesRequest,
    ResponseStore,
    deleted,
    event_bytes,
    new_response_id,
    pack,
    response_not_found,
    translate,
    translation_timeout,
    unpack,
)
from sfnode.head.api.schema import parse_body
from sfnode.head.api.translated import BuilderWriter, field_renamed
from sfnode.head.fleet.backend import BackendStatus
from sfnode.runtime.http_guard import HttpError

_log = Logger(namespace="sfnode.head.api.http")
_T = TypeVar("_T")


class ResponsesHost(Host, Protocol):
    """The API, with its store of responses."""

    responses: ResponseStore

    def authorized(self, request: Any) -> bytes | None: ...


class ResponsesExchange(Exchange):
    """One ``/v1/responses`` request (see the module's docstring): the chat exchange with a
    translated body and a :class:`ResponsesWriter`."""

    def __init__(self, api: ResponsesHost, request: Any) -> None:
        super().__init__(api, request, chat=True)
        self.store = api.responses
        self.ident = new_response_id()
        self.translated: ResponsesRequest | None = None
        permit = request.permit
        self.owner: bytes | None = permit.key if permit is not None else None
        """The API key the request came with (None without keys): its stored responses only."""

    def _prepare_chat(
        self, data: bytes | dict[str, Any], statuses: Mapping[str, BackendStatus]
    ) -> Deferred[Prepared]:
        """Parsed on a worker, the stored conversation it continues read on the reactor (the
        store is the reactor's), translated on a worker (both in the client's turn, within
        ``--template-timeout``), then checked and rendered as the chat exchange does."""
        api = self.api
        client = client_of(self.request)

        def off_the_reactor(work: Callable[[], _T]) -> Deferred[_T]:
            seconds = api.template_timeout_s
            return api.workers.run(
                work, client, budget_s=seconds, refusal=lambda: translation_timeout(seconds)
            )

        def look_up(body: dict[str, Any]) -> Deferred[ResponsesRequest]:
            previous = body.get("previous_response_id")
            if not isinstance(previous, str):
                return off_the_reactor(lambda: translate(body))
            found = self.store.found(self.owner, previous)
            return found.addCallback(lambda data: off_the_reactor(lambda: translate(body, data)))

        def render(translated: ResponsesRequest) -> Deferred[Prepared]:
            self.translated = translated
            return Exchange._prepare_chat(self, translated.chat, statuses)

        parsed = off_the_reactor(lambda: data if isinstance(data, dict) else parse_body(data))
        return parsed.addCallback(look_up).addCallback(render)

    def _answer_error(self, error: HttpError) -> None:
        """Errors in the Responses API's names: once translated, an error about the chat
        body's ``max_completion_tokens`` is about the request's ``max_output_tokens``."""
        if self.translated is not None:
            error = field_renamed(error, "max_completion_tokens", "max_output_tokens")
        super()._answer_error(error)

    def _place(self, prepared: Prepared) -> None:
        assert self.translated is not None
        builder = ResponseBuilder(self.ident, self.created, prepared.request.model, self.translated)
        self.writer = ResponsesWriter(self, builder, self.store)
        super()._place(prepared)


@dataclass(eq=False)
class ResponsesWriter(BuilderWriter[ResponsesExchange, ResponseBuilder]):
    """A :class:`~sfnode.head.api.exchange.Writer` of Responses' shapes: every piece of output
    goes through the builder (streamed or not), the stream as its named events."""

    store: ResponseStore

    def encode(self, piece: Mapping[str, Any]) -> bytes:
        return event_bytes(piece)

    def opened(self) -> None:
        self._write(self.builder.started())

    def _usage_and_reason(self, completion_tokens: int) -> tuple[dict[str, int], str | None]:
        x = self.exchange
        finish = x.choices[0].finish if x.choices else None
        reason = "max_output_tokens" if finish == "length" else None
        return bodies.usage(len(x.prompt), completion_tokens), reason

    def closed(self, completion_tokens: int) -> None:
        self._write(self.builder.finished(*self._usage_and_reason(completion_tokens)))
        self._keep()

    def whole(self, completion_tokens: int) -> Any:
        body = self.builder.whole(*self._usage_and_reason(completion_tokens))
        self._keep()
        return body

    def _keep(self) -> None:
        """Store the conversation and the ``Response`` object, packed on a worker (it reads
        every message), kept on the reactor."""
        x = self.exchange
        translated = x.translated
        final = self.builder.final
        if translated is None or not translated.store or final is None:
            return
        conversation = self.builder.conversation()
        packed = x.api.workers.run(lambda: pack(conversation, final))
        self.store.keep(x.owner, x.ident, packed)
        packed.addErrback(
            lambda failure: _log.failure("storing {ident} failed", failure, ident=x.ident)
        )

    def failed(self, error: HttpError) -> None:
        event = self.builder.event(
            "error", code=error.code, message=error.message, param=error.param
        )
        self._write([event])


def stored_owner(api: ResponsesHost, request: Any) -> bytes | None:
    """Whose stored responses ``request`` may see: its API key (None on a head without keys),
    as :class:`ResponsesExchange` stores them."""
    return api.authorized(request) or None


def answer_stored(api: ResponsesHost, request: Any, ident: str) -> None:
    """``GET /v1/responses/{id}``: the stored ``Response`` object, unpacked on a worker in the
    client's turn, or the 404 of a response this key cannot see."""

    def unpacked(packed: bytes | None) -> Deferred[bytes | None]:
        if packed is None:
            _finish(request, response_not_found(ident))
            return succeed(None)

        def work() -> bytes | None:
            assert packed is not None
            return json.dumps(unpack(packed)[1]).encode()

        return api.workers.run(work, client_of(request))

    def write(body: bytes | None) -> None:
        if body is not None and not request.finished and not request._disconnected:
            request.setHeader(b"content-type", b"application/json")
            request.setHeader(b"content-length", b"%d" % len(body))
            request.write(body)
            request.finish()

    found = api.responses.found(stored_owner(api, request), ident).addCallback(unpacked)
    found.addCallback(write).addErrback(
        lambda failure: _finish(request, api.unexpected(failure, request))
    )


def delete_stored(api: ResponsesHost, request: Any, ident: str) -> bytes:
    """``DELETE /v1/responses/{id}``: forget it (what ``previous_response_id`` and ``GET``
    can reach), or the 404 of a response this key cannot see."""
    if not api.responses.delete(stored_owner(api, request), ident):
        error = response_not_found(ident)
        request.site.count(error.outcome)
        return answer_error(request, error)
    return answer(request, 200, deleted(ident))


def _finish(request: Any, error: HttpError) -> None:
    if not request.finished and not request._disconnected:
        request.site.count(error.outcome)
        request.write(answer_error(request, error))
        request.finish()


__all__ = [
    "ResponsesExchange",
    "ResponsesHost",
    "ResponsesWriter",
    "answer_stored",
    "delete_stored",
    "stored_owner",
]
