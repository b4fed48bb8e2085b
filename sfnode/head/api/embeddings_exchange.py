"""One ``/v1/embeddings`` request on the head (docs/api.md "/v1/embeddings"): the body checked,
its texts asked of the fleet's embedding nodes in chunks, the vectors answered in OpenAI's
shape.

Unlike a completion there is nothing to stream and nothing to cancel (an embedding is a pure
function of its texts, computed in one pass): :class:`EmbeddingsExchange` answers once, or
writes nothing when its client went away meanwhile.

This module must never read the fleet's internals (only the backend's
:class:`~sfnode.head.fleet.backend.EmbeddingBackend` and status), never block the reactor, and
never write to a request twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from twisted.internet import defer
from twisted.internet.defer import Deferred, FirstError
from twisted.python.failure import Failure

from sfnode.generation import Embedded
from sfnode.head.api import failures
from sfnode.head.api.embeddings import (
    EmbeddingsRequest,
    chunks,
    embeddings_body,
    parse_embeddings,
)
from sfnode.head.api.exchange import answer, answer_error
from sfnode.head.api.gate import GateLimits, body_too_large
from sfnode.head.api.metrics import HeadMetrics
from sfnode.head.api.schema import parse_body
from sfnode.head.fleet.backend import Backend, BackendStatus, FleetError
from sfnode.head.models.registry import ModelRegistry
from sfnode.runtime.http_guard import HttpError


class EmbeddingsHost(Protocol):
    """What an embeddings request asks of the API that owns it."""

    backend: Backend
    metrics: HeadMetrics
    limits: GateLimits
    models: ModelRegistry
    draining: bool

    def status(self, model: str | None = None) -> BackendStatus: ...

    def unexpected(self, failure: Failure, request: Any = None) -> HttpError: ...


class EmbeddingsExchange:
    """One ``/v1/embeddings`` request (see the module's docstring)."""

    def __init__(self, api: EmbeddingsHost, request: Any) -> None:
        self.api = api
        self.request = request
        self.gone = False
        """The client went away: nothing is written."""
        self.parsed: EmbeddingsRequest | None = None

    def start(self) -> None:
        self.request.notifyFinish().addErrback(self._lost)
        try:
            asked = self._ask()
        except Exception:
            # An HttpError is answered as such; anything else as an unexpected failure.
            asked = defer.fail()
        asked.addCallbacks(self._answer, self._failed).addErrback(self._unexpected)

    def _ask(self) -> Deferred[list[Embedded]]:
        """Check the body and ask the fleet for every chunk of its texts."""
        api = self.api
        if self.request.permit is None:
            raise RuntimeError(f"an embedding reached {self.request.path!r} unscreened")
        if api.draining:
            raise failures.draining()
        data = self.request.content.getvalue()
        if len(data) > api.limits.max_body:
            raise body_too_large(api.limits.max_body)
        parsed = self.parsed = parse_embeddings(self.translate(parse_body(data)), self._known)
        status = api.status(parsed.model)
        embeddings = api.backend.embeddings
        if embeddings is None or (status.embedding_nodes == 0 and status.serving_nodes > 0):
            raise HttpError(
                400,
                f"the model '{parsed.model}' does not embed: its nodes generate text (see "
                "/v1/models, capabilities.embeddings)",
                param="model",
                code="model_not_embedding",
            )
        parts = [embeddings.embed(parsed.model, texts) for texts in chunks(parsed.texts)]
        return defer.gatherResults(parts, consumeErrors=True)

    def translate(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ``/v1/embeddings`` body of the request's body (another API's: its subclass)."""
        return body

    def body(self, parts: Sequence[Embedded]) -> dict[str, Any]:
        """The answer of the vectors ``parts``, in the API's shape."""
        assert self.parsed is not None
        return embeddings_body(self.parsed, parts)

    def shaped(self, error: HttpError) -> HttpError:
        """``error`` in the API's shape."""
        return error

    def _known(self, model: str) -> bool:
        """A model the head serves, or one a live node serves as an embedding model."""
        return model in self.api.models.names() or self.api.status(model).embedding_nodes > 0

    def _answer(self, parts: Sequence[Embedded]) -> None:
        assert self.parsed is not None
        self.api.metrics.prompt_tokens.inc(sum(part.tokens for part in parts))
        self.api.metrics.requests.labels("ok").inc()
        self._write(200, self.body(parts))

    def _failed(self, failure: Failure) -> None:
        """A refusal, or the fleet's error, answered as such; anything else goes on."""
        error = failure.value
        if isinstance(error, FirstError):
            error = error.subFailure.value
        if isinstance(error, FleetError):
            error = failures.fleet_error(error, "input")
        if not isinstance(error, HttpError):
            failure.raiseException()
        assert isinstance(error, HttpError)
        self.api.metrics.requests.labels(error.outcome).inc()
        self._write(error.status, error)

    def _unexpected(self, failure: Failure) -> None:
        """Anything else: one log line, one count, a JSON 500."""
        self._write(500, self.api.unexpected(failure, self.request))

    def _write(self, status: int, body: dict[str, Any] | HttpError) -> None:
        if self.gone:
            return
        request = self.request
        if isinstance(body, HttpError):
            request.write(answer_error(request, self.shaped(body)))
        else:
            request.write(answer(request, status, body))
        request.finish()

    def _lost(self, failure: Failure) -> None:
        self.gone = True


__all__ = ["EmbeddingsExchange", "EmbeddingsHost"]
