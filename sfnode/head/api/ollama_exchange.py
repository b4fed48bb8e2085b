"""Ollama's API on the head (docs/api.md "Ollama's API"): ``/api/chat`` and ``/api/generate``
as chat exchanges translated in and answered as Ollama answers (NDJSON lines when streamed,
which is the default, or one body), ``/api/embed`` as the embeddings exchange
(:class:`OllamaEmbedExchange`), and the model listings ``/api/tags``, ``/api/show`` and
``/api/version``.

:class:`OllamaExchange` is a :class:`~sfnode.head.api.translated.TranslatedExchange` whose body
:func:`sfnode.head.api.ollama.translate_chat` or :func:`~sfnode.head.api.ollama.translate_generate`
wrote, whose :class:`OllamaWriter` writes the lines of an
:class:`~sfnode.head.api.ollama.OllamaBuilder`, and whose errors are in Ollama's shape.
:data:`ROUTES` is what the resource tree serves under ``/api``.

This module must never decide anything the chat exchange decides (placement, back-pressure,
budgets, errors and their statuses, metrics: those stay in :mod:`sfnode.head.api.exchange`),
never parse a chat or show body on the reactor (an embed body is parsed where
``/v1/embeddings`` parses its own), and never write to a request once it is done or gone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from twisted.web.server import NOT_DONE_YET

from sfnode import __version__
from sfnode.generation import Embedded
from sfnode.head.api.embeddings import embeddings_body
from sfnode.head.api.embeddings_exchange import EmbeddingsExchange
from sfnode.head.api.exchange import Host, Prepared, answer, client_of
from sfnode.head.api.gate import Route
from sfnode.head.api.ollama import (
    OllamaBuilder,
    embed_body,
    model_not_found,
    ndjson,
    ollama_error,
    show,
    tags,
    timestamp,
    translate_chat,
    translate_embed,
    translate_generate,
)
from sfnode.head.api.schema import parse_body
from sfnode.head.api.translated import BuilderWriter, TranslatedExchange, field_renamed
from sfnode.runtime.http_guard import HttpError

NS = 1_000_000_000
"""Ollama counts durations in nanoseconds."""


class OllamaExchange(TranslatedExchange):
    """One ``/api/chat`` (``generate`` False) or ``/api/generate`` request."""

    def __init__(self, api: Host, request: Any, *, generate: bool) -> None:
        super().__init__(api, request, chat=True)
        self.generate = generate
        self.stream.framed = False  # NDJSON lines: no ids, nothing to resume

    def translate(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return translate_generate(body) if self.generate else translate_chat(body)

    def shaped(self, error: HttpError) -> HttpError:
        """Ollama's shape; once translated, an error about the chat body's ``max_tokens``
        names ``options.num_predict``."""
        if self.chat_body is not None:
            error = field_renamed(error, "max_tokens", "options.num_predict")
        return ollama_error(error)

    def _place(self, prepared: Prepared) -> None:
        created = timestamp(self.received)
        builder = OllamaBuilder(prepared.request.model, created, chat=not self.generate)
        self.writer = OllamaWriter(self, builder)
        super()._place(prepared)


class OllamaWriter(BuilderWriter[OllamaExchange, OllamaBuilder]):
    """A :class:`~sfnode.head.api.exchange.Writer` of Ollama's shapes: every piece of output
    goes through the builder, a stream as NDJSON lines (the done line says a choice ended)."""

    def encode(self, piece: Mapping[str, Any]) -> bytes:
        return ndjson(piece)

    def opened(self) -> None:
        self.exchange.request.setHeader(b"content-type", b"application/x-ndjson")

    def _end(self, completion_tokens: int) -> tuple[str, dict[str, int]]:
        """``done_reason`` and the counts of the done line."""
        x = self.exchange
        now = x.api.reactor.seconds()
        first = x.first_token_at if x.first_token_at is not None else now
        finish = x.choices[0].finish if x.choices else None
        counts = {
            "total_duration": round((now - x.received) * NS),
            "load_duration": 0,
            "prompt_eval_count": len(x.prompt),
            "prompt_eval_duration": round((first - x.received) * NS),
            "eval_count": completion_tokens,
            "eval_duration": round((now - first) * NS),
        }
        return ("length" if finish == "length" else "stop"), counts

    def closed(self, completion_tokens: int) -> None:
        self._write([self.builder.done(*self._end(completion_tokens))])

    def whole(self, completion_tokens: int) -> Any:
        return self.builder.whole(*self._end(completion_tokens))

    def failed(self, error: HttpError) -> None:
        self._write([{"error": error.message}])


# --------------------------------------------------------------------------------------------
# The other routes


def _chat(api: Any, request: Any) -> int:
    OllamaExchange(api, request, generate=False).start()
    return NOT_DONE_YET


def _generate(api: Any, request: Any) -> int:
    OllamaExchange(api, request, generate=True).start()
    return NOT_DONE_YET


class OllamaEmbedExchange(EmbeddingsExchange):
    """``/api/embed``: ``/v1/embeddings``' exchange with Ollama's body, answer and errors."""

    def translate(self, body: dict[str, Any]) -> dict[str, Any]:
        return translate_embed(body)

    def body(self, parts: Sequence[Embedded]) -> dict[str, Any]:
        assert self.parsed is not None
        shown = embeddings_body(replace(self.parsed, base64=False), parts)
        vectors = [datum["embedding"] for datum in shown["data"]]
        return embed_body(self.parsed.model, vectors, shown["usage"]["prompt_tokens"])

    def shaped(self, error: HttpError) -> HttpError:
        return ollama_error(error)


def _embed(api: Any, request: Any) -> int:
    OllamaEmbedExchange(api, request).start()
    return NOT_DONE_YET


def _embeds(api: Any, name: str) -> bool:
    status = api.status(name)
    return bool(status.embedding_nodes and not status.serving_nodes)


def _tags(api: Any, request: Any) -> bytes:
    modified = timestamp(api.reactor.seconds())
    return answer(request, 200, tags([(n, _embeds(api, n)) for n in api.models.names()], modified))


def _show(api: Any, request: Any) -> int:
    """``/api/show``: its body parsed on the workers, the model looked up on the reactor."""
    data = request.content.getvalue()

    def found(body: dict[str, Any]) -> None:
        name = body.get("model", body.get("name"))
        if request.finished or request._disconnected:
            return
        if not isinstance(name, str) or name not in api.models.names():
            error = model_not_found(str(name))
            request.site.count(error.outcome)
            request.write(answer(request, error.status, error.body()))
        else:
            shown = show(name, api.status(name).window, _embeds(api, name))
            request.write(answer(request, 200, shown))
        request.finish()

    def failed(failure: Any) -> None:
        if not (request.finished or request._disconnected):
            error = ollama_error(failure.value if failure.check(HttpError) else
                                 api.unexpected(failure, request))  # fmt: skip
            request.site.count(error.outcome)
            request.write(answer(request, error.status, error.body()))
            request.finish()

    parsed = api.workers.run(lambda: parse_body(data), client_of(request))
    parsed.addCallback(found).addErrback(failed)
    return NOT_DONE_YET


def _version(api: Any, request: Any) -> bytes:
    return answer(request, 200, {"version": __version__})


Serve = Callable[[Any, Any], "bytes | int"]
_POST = Route(methods=(b"POST",), completion=True)
_GET = Route(methods=(b"GET",))
ROUTES: dict[bytes, tuple[Route, Serve]] = {
    b"chat": (_POST, _chat),
    b"embed": (_POST, _embed),
    b"generate": (_POST, _generate),
    b"show": (_POST, _show),
    b"tags": (_GET, _tags),
    b"version": (_GET, _version),
}
"""What ``/api/{name}`` serves: its route (a POST that reads a body is a completion route for
the front door) and the function that answers it (the API and the request in)."""


__all__ = ["ROUTES", "OllamaEmbedExchange", "OllamaExchange", "OllamaWriter"]
