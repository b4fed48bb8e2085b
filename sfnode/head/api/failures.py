"""The head's error mapping: which OpenAI error answers which failure, in one place.

The request checks (:mod:`sfnode.head.api.schema`) raise their own :class:`HttpError`; this module
holds the errors the HTTP layer answers itself (a prompt longer than any window, a head that is
draining or has no node, an unexpected failure) and :func:`fleet_error`, the answer to each way
a generation can fail in the backend (docs/protocol.md section 8.5 for the queue's).  Each
error carries its HTTP status, OpenAI's ``type`` and ``code``, and the ``sfhead_requests_total``
label it is counted under (``outcome``).

This module is pure: it must never log, count, touch a request or the reactor; it only says
what the answer is.
"""

from __future__ import annotations

from sfnode.generation import StreamTooLong
from sfnode.head.fleet.backend import (
    ClientQueueFull,
    ConstraintRefused,
    ConstraintsUnavailable,
    FleetError,
    GenerationTimedOut,
    LogprobsUnavailable,
    NodeDeclined,
    QueueFull,
)
from sfnode.head.link import LinkError
from sfnode.runtime.http_guard import HttpError


def too_long(length: int, window: int, param: str) -> HttpError:
    """A prompt of ``length`` tokens that no window of ``window`` tokens holds."""
    return _context_exceeded(window, f"{length} tokens", param)


def too_many_characters(characters: int, window: int, param: str) -> HttpError:
    """A prompt with more characters than ``window`` tokens can hold (never tokenized)."""
    return _context_exceeded(
        window, f"{characters} characters, more than that many tokens can hold", param
    )


def _context_exceeded(window: int, what: str, param: str) -> HttpError:
    return HttpError(
        400,
        f"This model's maximum context length is {window} tokens; the prompt has {what}.",
        param=param,
        code="context_length_exceeded",
        outcome="too_long",
    )


def no_chat_template(model: str) -> HttpError:
    """A chat request (``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``) for a
    model whose files carry no chat template: the head never guesses a format (docs/api.md
    "Models without a chat template")."""
    return HttpError(
        400,
        f"The model {model} has no chat template (its files carry none), so it cannot answer "
        f"chat requests; /v1/completions serves it with a prompt you format yourself.",
        param="model",
        code="no_chat_template",
    )


def budget_too_small(budget: int, shortest: int, param: str) -> HttpError:
    """A constrained request whose budget of ``budget`` tokens is below the ``shortest``
    answer its grammar allows (docs/api.md "Budgets")."""
    return HttpError(
        400,
        f"{param} is {budget}, but the shortest answer the requested format allows takes "
        f"{shortest} tokens: set {param} to at least {shortest}.",
        param=param,
        code="max_tokens_too_small",
    )


def embeds_only(model: str) -> HttpError:
    """A completion naming a model whose live nodes only embed (docs/api.md
    "/v1/embeddings")."""
    return HttpError(
        400,
        f"the model '{model}' is an embedding model: ask /v1/embeddings",
        param="model",
        code="model_not_generative",
    )


def unavailable(message: str, code: str = "no_node_available") -> HttpError:
    return HttpError(503, message, kind="service_unavailable", code=code, outcome="unavailable")


def draining() -> HttpError:
    return unavailable("the head is shutting down and takes no new requests", "draining")


def internal_error() -> HttpError:
    """What a client gets for a failure nobody expected (the log says why)."""
    return HttpError(
        500,
        "internal error: the head failed to answer this request (its log says why)",
        kind="server_error",
        outcome="error",
    )


def missing_logprobs() -> HttpError:
    """A node streamed tokens without the logprobs the request asked for: the fleet places
    such requests only on nodes that return them, so this is a defect, answered as one."""
    return HttpError(
        502,
        "a node returned tokens without the logprobs asked for",
        kind="server_error",
        outcome="error",
    )


def fleet_error(error: BaseException, param: str) -> HttpError | None:
    """The answer to a generation that failed with ``error`` (None: an unexpected failure,
    which the caller answers with :func:`internal_error` and logs); ``param`` is the request
    field a too-long prompt is blamed on."""
    if isinstance(error, StreamTooLong):
        return too_long(error.length, error.max, param)
    if isinstance(error, NodeDeclined):
        return HttpError(502, str(error), kind="server_error", outcome="error")
    if isinstance(error, ClientQueueFull):
        return HttpError(
            429,
            str(error),
            kind="requests",
            code="rate_limit_exceeded",
            outcome="rate_limited",
            headers={b"retry-after": b"1"},
        )
    if isinstance(error, QueueFull):
        return unavailable(str(error), "queue_full")
    if isinstance(error, GenerationTimedOut):
        return HttpError(
            504, str(error), kind="timeout_error", code="generation_timeout", outcome="timeout"
        )
    if isinstance(error, ConstraintsUnavailable):
        return HttpError(
            400,
            f"{error}: this fleet cannot enforce response_format, tools, logit_bias or penalties",
            param="response_format",
            code="unsupported_parameter",
        )
    if isinstance(error, ConstraintRefused):
        return HttpError(502, str(error), kind="server_error", outcome="error")
    if isinstance(error, LogprobsUnavailable):
        return HttpError(
            400,
            f"logprobs are not supported here: {error}",
            param="logprobs",
            code="unsupported_parameter",
        )
    if isinstance(error, (FleetError, LinkError)):
        return unavailable(str(error))
    return None


__all__ = [
    "draining",
    "fleet_error",
    "internal_error",
    "missing_logprobs",
    "no_chat_template",
    "too_long",
    "too_many_characters",
    "unavailable",
]
