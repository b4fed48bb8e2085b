"""The OpenAI request schema of the head: a request body in, a checked request or an error out.

:func:`parse_body` turns the bytes of a POST body into a JSON object (nesting and Unicode
checked); :func:`parse_request` checks every field of ``/v1/chat/completions`` and
``/v1/completions`` and returns a :class:`CompletionRequest` that says what to render and how
to generate; anything wrong is an :class:`HttpError` in OpenAI's shape, naming the field.

Parameters the fleet does not honour (``functions``, ``echo``, audio, ...) are refused with
400 naming them, unless they carry their neutral value (``"echo": false``, ...), so no client
believes it got what it did not; unknown fields are refused as OpenAI does.  Logprobs are
honoured: ``logprobs`` and ``top_logprobs`` (0 to 20) on chat, ``logprobs`` (0 to 5) on
completions, as OpenAI bounds them.  ``response_format``, ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` (chat), ``logit_bias`` and the penalties become the request's
:class:`~sfnode.linkf.wire.Constraint` (docs/protocol.md section 12.3), checked here
(:mod:`sfnode.decoding.constraint`); its grammar is compiled by the caller, off the reactor
(:mod:`sfnode.head.api.grammars`), before any node is asked.  The lists are
:data:`UNSUPPORTED`, :data:`IGNORED`, :data:`CONSTRAINT_FIELDS` and :data:`TOOL_FIELDS`, and
docs/operating.md and docs/api.md repeat them.

This module is pure: it must never tokenize, touch the network, the reactor or a thread, never
raise anything but :class:`HttpError` for any JSON value, and never put more than
:data:`ECHO_LIMIT` characters of the client's input into an error message.
"""

from __future__ import annotations

import json
import json.scanner
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sfnode.decoding.constraint import (
    ConstraintError,
    response_format_grammar,
    sampler_controls,
    tools_grammar,
)
from sfnode.head.models.chat import ChatMessage, ChatToolCall
from sfnode.linkf.wire import Constraint, GenParams, ToolChoice
from sfnode.runtime.http_guard import ECHO_LIMIT, HttpError, clip

MAX_N = 8
"""The most choices one request may ask for (each is its own generation, on its own lane)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives chat's ``top_logprobs`` may ask for (OpenAI's bound)."""
MAX_COMPLETION_LOGPROBS = 5
"""The most alternatives completions' ``logprobs`` may ask for (OpenAI's bound)."""
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
"""The longest stop string (the streamed text holds back that many characters)."""
MAX_JSON_DEPTH = 32
"""The deepest nesting of a request body; OpenAI's own requests need 6."""
C_PARSE_VALUES = 20_000
"""A body with more values than this is parsed without holding the interpreter's lock
throughout (:func:`_loads`)."""
MAX_JSON_ITEMS = 10_000
"""The most items of one array or object in a request body (messages, input items, tools,
schema properties ...), checked before any field is read."""
U32_MAX = 0xFFFF_FFFF
U64_MASK = (1 << 64) - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Message roles; ``developer`` is rendered as ``system`` (what OpenAI does for models that
predate it)."""


# --------------------------------------------------------------------------------------------
# The body


def parse_body(data: bytes) -> dict[str, Any]:
    """The JSON object in a request body; every failure is a 400."""
    if not data.strip():
        raise HttpError(400, "the request body is empty: send a JSON object")
    try:
        body = _loads(data)
    except RecursionError as e:
        raise _too_deep() from e
    except UnicodeDecodeError as e:
        raise HttpError(400, f"the body is not UTF-8: byte {e.start} cannot be decoded") from e
    except ValueError as e:
        raise HttpError(400, f"the body is not valid JSON: {clip(str(e), 200)}") from e
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    _check_depth(body)
    return body


def _loads(data: bytes) -> Any:
    """``json.loads``, or for a body of many values (more than :data:`C_PARSE_VALUES` commas
    and brackets, counted first) the json module's pure-Python scanner: the C one holds the
    interpreter's lock for the whole parse (a quarter of a second for 4 MiB of numbers, during
    which the reactor's thread cannot run), the Python one lets it go every few
    milliseconds."""
    values = data.count(b",") + data.count(b"[") + data.count(b"{")
    if values <= C_PARSE_VALUES:
        return json.loads(data)
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(data.decode("utf-8"))


def _too_deep() -> HttpError:
    return HttpError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep")


def _check_depth(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and an array or object of more than
    :data:`MAX_JSON_ITEMS` (iteratively: no recursion), before any field is converted."""
    stack: list[tuple[Any, int, str]] = [
        (child, 2, name) for name, child in body.items() if isinstance(child, (dict, list))
    ]
    if len(body) > MAX_JSON_ITEMS:
        raise _too_many(None)
    while stack:
        item, depth, field_name = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if len(item) > MAX_JSON_ITEMS:
            raise _too_many(field_name)
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, field_name))


def _too_many(field_name: str | None) -> HttpError:
    where = f"{clip(field_name)} holds" if field_name is not None else "the body holds"
    return HttpError(
        400,
        f"{where} an array or object of more than {MAX_JSON_ITEMS} items (the limit of this "
        "server)",
        param=None if field_name is None else clip(field_name),
        code="too_many_items",
    )


def model_not_found(model: str) -> HttpError:
    """The 404 for a model no node serves (OpenAI's ``model_not_found``)."""
    return HttpError(
        404,
        f"The model '{clip(model)}' does not exist",
        param="model",
        code="model_not_found",
        outcome="not_found",
    )


def tool_array(value: Any, chat_tool: Callable[[int, Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's ``tools`` from another API's: ``chat_tool(i, tool)`` translates (or refuses) each
    of an array; None is no tools."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise HttpError(400, "tools must be an array", param="tools")
    return [chat_tool(i, tool) for i, tool in enumerate(value)]


def checked_text(value: str, param: str) -> str:
    """``value`` if it is valid Unicode (no lone surrogate, which JSON's ``\\ud800`` allows)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError(
            400,
            f"{param} is not valid Unicode: a lone surrogate at character {e.start}",
            param=param,
        ) from e
    return value


# --------------------------------------------------------------------------------------------
# Parameters: honoured, ignored, refused


def _neutral(*values: Any) -> Callable[[Any], bool]:
    """A check that a value is one of ``values``: ``None``, ``False`` and strings by identity
    of type, numbers by value (``0`` and ``0.0`` alike, never ``False``)."""

    def check(value: Any) -> bool:
        for v in values:
            if v is None or isinstance(v, (bool, str)):
                if type(value) is type(v) and value == v:
                    return True
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == v:
                return True
        return False

    return check


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: v is None or v == [], "functions are not supported"),
    "function_call": (_neutral(None, "none"), "functions are not supported"),
    "echo": (_neutral(False, None), "echo is not supported"),
    "best_of": (_neutral(None, 1), "best_of is not supported (use n)"),
    "suffix": (_neutral(None, ""), "suffix (insertion) is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (_neutral(None), "audio output is not supported"),
    "prediction": (_neutral(None), "predicted outputs are not supported"),
    "reasoning_effort": (_neutral(None), "reasoning_effort is not supported"),
    "verbosity": (_neutral(None), "verbosity is not supported"),
    "web_search_options": (_neutral(None), "web search is not supported"),
}
"""Parameters the fleet does not honour: accepted only with the neutral value, else a 400
naming them (the value is the check for "neutral", and the reason)."""

IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
    }
)
"""Accepted and ignored: they do not change what is generated."""

CONSTRAINT_FIELDS = (
    "response_format", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip
"""Honoured on chat and completions, as a constraint the nodes enforce (docs/protocol.md
section 12.3)."""
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
"""Honoured on chat (docs/api.md "Tools")."""

_CHAT_FIELDS = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "min_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
        "top_logprobs", *CONSTRAINT_FIELDS, *TOOL_FIELDS,
    }
)  # fmt: skip
_COMPLETION_FIELDS = frozenset(
    {
        "model", "prompt", "max_tokens", "temperature", "top_p", "min_p", "top_k", "seed",
        "stop", "stream", "stream_options", "n", "logprobs", *CONSTRAINT_FIELDS,
    }
)  # fmt: skip


def _check_fields(body: Mapping[str, Any], chat: bool, n: int) -> None:
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name, value in body.items():
        if name in known or name in IGNORED:
            continue
        rule = UNSUPPORTED.get(name)
        if rule is not None:
            neutral, reason = rule
            if neutral(value) or (name == "best_of" and value == n and not isinstance(value, bool)):
                continue
            raise HttpError(
                400,
                f"{name} is not supported by this server: {reason}",
                param=name,
                code="unsupported_parameter",
            )
        raise HttpError(
            400,
            f"Unrecognized request argument supplied: {clip(name)}",
            param=clip(name),
            code="unknown_parameter",
        )


# --------------------------------------------------------------------------------------------
# Fields


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and math.isnan(value))
    ):
        # isnan only of a float: an integer of 400 digits has no float, and must be a 400.
        raise HttpError(400, f"{name} must be a number", param=name)
    if not low <= value <= high:
        raise HttpError(400, f"{name} must be between {low:g} and {high:g}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{name} must be an integer", param=name)
    return value


def _at_least(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = _integer(body, name)
    if value is not None and value < low:
        raise HttpError(400, f"{name} must be at least {low}", param=name)
    return value


def _messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise HttpError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            shown = clip(role) if isinstance(role, str) else json.dumps(role)[:ECHO_LIMIT]
            raise HttpError(
                400,
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}"
                + ("" if role is None else f", not {shown}"),
                param=f"{where}.role",
            )
        for name in ("function_call", "audio"):
            if message.get(name) not in (None, []):
                raise HttpError(
                    400,
                    f"{where}.{name} is not supported by this server",
                    param=f"{where}.{name}",
                    code="unsupported_parameter",
                )
        calls = _tool_calls(message, where) if role == "assistant" else ()
        if role != "assistant" and message.get("tool_calls") not in (None, []):
            raise HttpError(
                400, f"{where}.tool_calls is only allowed on assistant messages", param=where
            )
        call_id = None
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise HttpError(
                    400,
                    f"{where}.tool_call_id is required on tool messages (a string)",
                    param=f"{where}.tool_call_id",
                )
            checked_text(call_id, f"{where}.tool_call_id")
        content = _content(message, i, empty_ok=bool(calls))
        out.append(ChatMessage("system" if role == "developer" else role, content, calls, call_id))
    return tuple(out)


def _tool_calls(message: Mapping[str, Any], where: str) -> tuple[ChatToolCall, ...]:
    """An assistant message's ``tool_calls``: ``[{id, type: function, function: {name,
    arguments}}]``, ``arguments`` a string (JSON text, as OpenAI returns it)."""
    value = message.get("tool_calls")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise HttpError(400, f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise HttpError(
                400, f"{at} must be {{type: function, id, function: {{name, arguments}}}}",
                param=at,
            )  # fmt: skip
        ident, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        if not isinstance(ident, str) or not isinstance(name, str):
            raise HttpError(400, f"{at}.id and {at}.function.name must be strings", param=at)
        if arguments is None:
            arguments = "{}"
        if not isinstance(arguments, str):
            raise HttpError(400, f"{at}.function.arguments must be a string of JSON", param=at)
        calls.append(
            ChatToolCall(
                checked_text(ident, f"{at}.id"),
                checked_text(name, f"{at}.function.name"),
                checked_text(arguments, f"{at}.function.arguments"),
            )
        )
    return tuple(calls)


def _content(message: Mapping[str, Any], i: int, *, empty_ok: bool = False) -> str:
    where = f"messages[{i}].content"
    content = message.get("content")
    if content is None and (empty_ok or message.get("role") == "assistant"):
        return ""
    if isinstance(content, str):
        return checked_text(content, where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise HttpError(
                    400,
                    f"{where}[{j}]: only text content is supported (no images, audio or files)",
                    param=f"{where}[{j}]",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise HttpError(400, f"{where}[{j}].text must be a string", param=f"{where}[{j}]")
            parts.append(checked_text(text, f"{where}[{j}].text"))
        return "".join(parts)
    raise HttpError(
        400, f"{where} must be a string or an array of text parts", param=f"messages[{i}].content"
    )


def _token_ids(value: list[Any], vocab_size: int) -> tuple[int, ...]:
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise HttpError(
                400,
                f"prompt token ids must be integers from 0 to {vocab_size - 1} (the model's "
                "vocabulary)",
                param="prompt",
            )
    return tuple(value)


def _prompt(body: Mapping[str, Any], vocab_size: int) -> tuple[str | None, tuple[int, ...]]:
    """(text, ()) or (None, token ids)."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str):
        if not raw:
            raise HttpError(400, "prompt must not be empty", param="prompt")
        return checked_text(raw, "prompt"), ()
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        return None, _token_ids(raw, vocab_size)
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise HttpError(
            400,
            "a batch of several prompts is not supported: send one prompt per request",
            param="prompt",
        )
    if raw is None:
        raise HttpError(400, "prompt is required", param="prompt")
    if raw == []:
        raise HttpError(400, "prompt must not be empty", param="prompt")
    raise HttpError(400, "prompt must be a string or an array of token ids", param="prompt")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise HttpError(
            400,
            f"stop must be a string or up to {MAX_STOP_STRINGS} strings of at most "
            f"{MAX_STOP_CHARS} characters",
            param="stop",
        )
    return tuple(checked_text(s, "stop") for s in stops)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """How many most likely tokens to list beside each chosen one (None: no logprobs).

    Chat: ``logprobs: true`` and ``top_logprobs`` from 0 to :data:`MAX_TOP_LOGPROBS`;
    completions: ``logprobs`` from 0 to :data:`MAX_COMPLETION_LOGPROBS` (both as OpenAI).
    """
    if not chat:
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        count = value if isinstance(value, int) and not isinstance(value, bool) else None
        if count is None or not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise HttpError(
                400,
                f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}",
                param="logprobs",
            )
        return count
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise HttpError(400, "logprobs must be a boolean", param="logprobs")
    top = _integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise HttpError(
            400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if not asked:
        if top:
            raise HttpError(
                400,
                "top_logprobs needs logprobs: true (logprobs must be enabled to return the "
                "most likely tokens)",
                param="top_logprobs",
            )
        return None
    return top or 0


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise HttpError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise HttpError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, dict):
        raise HttpError(400, "stream_options must be an object", param="stream_options")
    for name, value in options.items():
        if name not in ("include_usage", "include_obfuscation"):
            raise HttpError(
                400,
                f"Unrecognized stream_options argument: {clip(str(name))}",
                param="stream_options",
                code="unknown_parameter",
            )
        if value is not None and not isinstance(value, bool):
            raise HttpError(
                400, f"stream_options.{name} must be a boolean", param=f"stream_options.{name}"
            )
    return stream, bool(options.get("include_usage"))


# --------------------------------------------------------------------------------------------
# The request


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index`` of a request seeded ``seed`` (u64).

    Choice 0 uses the request's seed itself, so ``n: 1`` and the first of ``n`` choices agree;
    the others get splitmix64 of the seed and the index, distinct and reproducible.
    """
    if index == 0:
        return seed & U64_MASK
    z = (seed + index * 0x9E3779B97F4A7C15) & U64_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64_MASK
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A checked request: what to render, what to generate, and how to answer.

    Exactly one of ``messages`` (chat), ``prompt_text`` and ``prompt_ids`` (completions) is
    set.
    """

    chat: bool
    model: str
    messages: tuple[ChatMessage, ...] = ()
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    n: int = 1
    params: GenParams = field(default_factory=GenParams)
    """The sampling parameters of choice 0 (see :meth:`choice_params`)."""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """None: no logprobs; else each token's logprob and this many most likely tokens
    (``top_logprobs`` on chat, ``logprobs`` on completions); ``params.logprobs`` is one
    more (docs/protocol.md section 12.1)."""
    constraint: Constraint | None = None
    """The grammar and sampler controls of ``response_format``, ``tools``/``tool_choice``,
    ``logit_bias`` and the penalties (docs/protocol.md section 12.3); None: none asked."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """The checked ``tools`` (OpenAI's array), for the chat template or the generic
    rendering."""
    calls: bool = False
    """The output may hold tool calls (read back into ``message.tool_calls``)."""
    max_tokens_param: str = "max_tokens"
    """The field the budget came from (what a budget error names)."""

    @property
    def characters(self) -> int:
        """The characters of text to render and tokenize (what the cheap length check sees)."""
        if self.prompt_text is not None:
            return len(self.prompt_text)
        tools = len(json.dumps(self.tools)) if self.tools else 0
        return tools + sum(m.characters for m in self.messages)

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt (what a length error names)."""
        return "messages" if self.chat else "prompt"

    def choice_params(self, index: int) -> GenParams:
        return replace(self.params, seed=choice_seed(self.params.seed, index))


def parse_request(
    body: Mapping[str, Any],
    *,
    chat: bool,
    models: Sequence[str],
    vocab_size: int,
    seed_source: Callable[[], int],
) -> CompletionRequest:
    """Check one request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``;
    raises :class:`HttpError` (400, or 404 for an unknown model)."""
    model = _model(body, models)
    n = _integer(body, "n")
    if n is None:
        n = 1
    if not 1 <= n <= MAX_N:
        raise HttpError(400, f"n must be between 1 and {MAX_N}", param="n")
    _check_fields(body, chat, n)
    messages: tuple[ChatMessage, ...] = ()
    text: str | None = None
    ids: tuple[int, ...] = ()
    if chat:
        messages = _messages(body)
    else:
        text, ids = _prompt(body, vocab_size)
    max_tokens_param = "max_completion_tokens"
    max_tokens = _at_least(body, max_tokens_param, 1) if chat else None
    if max_tokens is None:
        max_tokens_param = "max_tokens"
        max_tokens = _at_least(body, max_tokens_param, 1)
    params = _sampling(body, seed_source)
    stop = _stop(body)
    stream, include_usage = _stream(body)
    logprobs = _logprobs(body, chat)
    constraint, tools, calls = _constraint(body, chat, vocab_size)
    return CompletionRequest(
        chat=chat,
        model=model,
        messages=messages,
        prompt_text=text,
        prompt_ids=ids,
        # More than the window cannot be generated anyway; the wire field is a u32.
        max_tokens=None if max_tokens is None else min(max_tokens, U32_MAX),
        n=n,
        params=replace(params, logprobs=0 if logprobs is None else logprobs + 1),
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        constraint=constraint,
        tools=tools,
        calls=calls,
        max_tokens_param=max_tokens_param,
    )


def _model(body: Mapping[str, Any], models: Sequence[str]) -> str:
    """The served model the body names (the first one when it names none)."""
    model = body.get("model", models[0] if models else "")
    if not isinstance(model, str):
        raise HttpError(400, "model must be a string", param="model")
    if model not in models:
        raise model_not_found(model)
    return model


def _sampling(body: Mapping[str, Any], seed_source: Callable[[], int]) -> GenParams:
    """The sampling parameters of choice 0, defaulted (a seed drawn when none is given)."""
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    min_p = _number(body, "min_p", 0.0, 1.0)
    top_k = _at_least(body, "top_k", -1)
    seed = _integer(body, "seed")
    if seed is not None and not -(1 << 63) <= seed <= U64_MASK:
        raise HttpError(400, "seed must fit in 64 bits", param="seed")
    return GenParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        min_p=min_p or 0.0,
        # top_k beyond the vocabulary keeps every token, as top_k off (0) does.
        top_k=min(max(top_k or 0, 0), U32_MAX),
        seed=(seed_source() if seed is None else seed) & U64_MASK,
    )


def _constraint(
    body: Mapping[str, Any], chat: bool, vocab_size: int
) -> tuple[Constraint | None, tuple[Mapping[str, Any], ...], bool]:
    """(the constraint, the tools, whether calls may come) of a request: its
    ``response_format``, its tools (chat only) and its sampler controls, each checked here,
    before any node is asked; the grammar is compiled by the caller (a schema the grammar
    library cannot enforce is a 400 naming the field there, never served unconstrained)."""
    try:
        # Checked here, compiled by the caller (sfnode.head.api.grammars: off the reactor,
        # within a time limit, once per grammar).
        grammar = response_format_grammar(body.get("response_format"), check=False)
        tools = None
        if chat:
            tools = tools_grammar(
                body.get("tools"),
                body.get("tool_choice"),
                body.get("parallel_tool_calls"),
                check=False,
            )
        controls = sampler_controls(
            logit_bias=body.get("logit_bias"),
            presence_penalty=body.get("presence_penalty"),
            frequency_penalty=body.get("frequency_penalty"),
            repetition_penalty=body.get("repetition_penalty"),
            vocab_size=vocab_size,
        )
    except ConstraintError as e:
        raise HttpError(400, clip(e.message, 300), param=e.param) from e
    calls = tools is not None and tools.choice is not ToolChoice.NONE
    if grammar is not None and calls:
        raise HttpError(
            400,
            "response_format cannot be combined with tools that may be called: send one, or "
            'tool_choice "none"',
            param="response_format",
        )
    if grammar is None:
        grammar = tools
    declared = tuple(body["tools"]) if tools is not None else ()
    if grammar is None and controls is None:
        return None, declared, False
    return Constraint(0, grammar, controls), declared, calls


__all__ = [
    "IGNORED",
    "MAX_N",
    "UNSUPPORTED",
    "ChatMessage",
    "ChatToolCall",
    "CompletionRequest",
    "checked_text",
    "choice_seed",
    "parse_body",
    "parse_request",
]
