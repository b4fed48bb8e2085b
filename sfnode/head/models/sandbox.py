"""The jinja2 sandbox chat templates run in on the head, bounded in what they build.

A chat template is code from a model file, and a node sends it (docs/protocol.md section 12.5).
jinja2's immutable sandbox keeps it from reaching Python; :func:`template_environment` adds what
the sandbox does not bound, every check made while the template runs, before or right after the
one C call that builds a value:

- **intermediate values**: no string, list or mapping longer than the render's cap (the ``~``
  concatenation, ``+``, ``*``, ``%`` formatting, every filter and every method call a template
  makes: their integer arguments and format widths checked first, ``join`` and ``replace``
  estimated first, every result measured);
- **the rendered text**: :func:`render_bounded` streams the template's output and stops at the
  cap (the head's cap is what the model's window can hold at all, so a prompt longer than it
  is refused while it is rendered, not after);
- ``tojson`` of something that is no JSON (a function, a macro) is a template error, as every
  template error (every bound's refusal is one too: a ``jinja2.TemplateError``, told apart by
  :func:`is_limit`).

The cap of a render is per thread (renders run on the head's worker threads, one at a time per
thread): :func:`render_bounded` sets it for the render's duration.

This module must never import torch or transformers, touch the reactor, or let a template
build a value past its cap before the check that refuses it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

MAX_TEMPLATE_STRING = 16 * 1024 * 1024
"""The longest string, list or mapping (in items) a chat template may build, and the most
characters it may render, whatever the window (a render's cap is at most this)."""
MAX_JSON_INDENT = 16
"""The deepest indent ``tojson`` writes."""
_WIDTH = re.compile(r"\d{8,}")
"""A run of digits in a format string that asks for a width or precision of ten million or
more (``"%99999999s"``, ``"{:>99999999}"``): built in one C call, refused before it."""

_caps = threading.local()


def limit_error(message: str) -> Exception:
    """A :class:`jinja2.exceptions.SecurityError` (a ``TemplateError``) saying which bound the
    template passed; its ``limit`` attribute is True."""
    from jinja2.exceptions import SecurityError

    error = SecurityError(message)
    error.limit = True  # type: ignore[attr-defined]
    return error


def is_limit(error: BaseException) -> bool:
    """Whether ``error`` is a bound of this module (not the template's own refusal)."""
    return getattr(error, "limit", False) is True


def current_cap() -> int:
    """The cap of the render running on this thread."""
    cap: int = getattr(_caps, "cap", MAX_TEMPLATE_STRING)
    return cap


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_result(value: Any, what: str) -> Any:
    cap = current_cap()
    if _size(value) > cap:
        raise limit_error(f"the chat template built a value of more than {cap} items with {what}")
    return value


WIDTHS = frozenset(
    {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate"}
)
"""Filters and string methods whose integer arguments are sizes of what they build."""
FORMATS = frozenset({"format", "format_map"})
"""Filters and string methods whose string is a format (its widths are sizes)."""


def _check_arguments(name: str, args: Iterable[Any], formats: Iterable[Any] = ()) -> None:
    """The integer arguments of a call of ``name`` that sizes what it builds, and the format
    strings it fills, within the cap."""
    cap = current_cap()
    if name in WIDTHS:
        for value in args:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > cap:
                raise limit_error(f"the chat template passed {name} a width over {cap}")
    for value in formats:
        if isinstance(value, str) and _WIDTH.search(value):
            raise limit_error(f"the chat template asked {name} for a width over {cap}")


def _check_join(items: Any, separator: str = "") -> None:
    if isinstance(items, (list, tuple)):
        total = sum(len(x) if isinstance(x, str) else 32 for x in items)
        total += len(separator) * max(len(items) - 1, 0)
        if total > current_cap():
            raise limit_error(f"the chat template joins more than {current_cap()} characters")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grows = len(new) - len(old)
        count = text.count(old) if old else len(text) + 1
        if grows > 0 and len(text) + count * grows > current_cap():
            raise limit_error(
                f"the chat template replaces into more than {current_cap()} characters"
            )


def _prechecked(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The checks made before a call named ``name`` (a filter, or a method of a string, whose
    string comes first in ``args``)."""
    values = (*args, *kwargs.values())
    _check_arguments(name, values, args[:1] if name in FORMATS else ())
    if name == "join" and args:
        _check_join(args[0] if isinstance(args[0], (list, tuple)) else args[-1])
    if name == "replace" and len(args) >= 3:
        _check_replace(*args[:3])


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a jinja filter) with its arguments checked first and its result after."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        # A filter marked pass_context/pass_environment gets those first: only values follow.
        values = tuple(a for a in args if not _is_jinja_internal(a))
        _prechecked(name, values, kwargs)
        return _check_result(function(*args, **kwargs), f"the {name} filter")

    for mark in ("jinja_pass_arg",):
        if hasattr(function, mark):
            setattr(bounded, mark, getattr(function, mark))
    bounded.__name__ = getattr(function, "__name__", name)
    return bounded


def _is_jinja_internal(value: Any) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (Environment, Context, EvalContext))


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """The checks before ``left operator right``."""
    cap = current_cap()
    if operator == "**" and isinstance(right, int) and abs(right) > 1024:
        raise limit_error("the chat template raised a number to an exponent over 1024")
    if operator == "*":
        for value, times in ((left, right), (right, left)):
            if isinstance(times, int) and _size(value) * times > cap:
                raise limit_error(
                    f"the chat template built a value of more than {cap} items with *"
                )
    if operator == "+" and _size(left) + _size(right) > cap:
        raise limit_error(f"the chat template built a value of more than {cap} items with +")
    if operator == "%" and isinstance(left, str):
        _check_arguments("%", (), (left,))


def _check_call(function: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The checks before a template calls ``function``; its name."""
    name = getattr(function, "__name__", "a function")
    target = getattr(function, "__self__", None)
    if isinstance(target, str):
        if name == "join" and args:
            _check_join(args[0], target)
        else:
            _prechecked(name, (target, *args), kwargs)
    return str(name)


def bounded_join(parts: tuple[Any, ...]) -> str:
    """``a ~ b ~ ...``, refused past the cap before it is joined."""
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    if sum(len(t) for t in texts) > current_cap():
        raise limit_error(
            f"the chat template built a string of more than {current_cap()} characters with ~"
        )
    return "".join(texts)


def _environment_class() -> Any:
    """The sandbox's class: jinja2's immutable sandbox, with ``~`` compiled to
    :func:`bounded_join` and every operator and call checked."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        """``a ~ b`` through the environment's ``bounded_join``."""

        def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        """The sandbox with every value a template builds bounded (see the module)."""

        code_generator_class = BoundedCode
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        bounded_join = staticmethod(bounded_join)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _check_result(super().call_binop(context, operator, left, right), operator)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            name = _check_call(__obj, args, kwargs)
            return _check_result(super().call(__context, __obj, *args, **kwargs), name)

    return Environment


def _generation_tag() -> Any:
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for
        training masks): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            body: list[nodes.Node] = parser.parse_statements(
                ("name:endgeneration",), drop_needle=True
            )
            return body

    return GenerationTag


def template_environment() -> Any:
    """The jinja2 sandbox chat templates run in, with the helpers transformers gives them and
    the bounds of this module."""
    environment = _environment_class()(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_tag(), "jinja2.ext.loopcontrols"],
    )
    environment.filters["tojson"] = _tojson
    environment.filters = {
        name: _bounded_filter(name, f) for name, f in environment.filters.items()
    }
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def render_bounded(template: Any, cap: int | None, **variables: Any) -> str:
    """``template`` rendered with ``variables``, its output and every value it builds at most
    ``cap`` characters (None: :data:`MAX_TEMPLATE_STRING`), counted as it streams.

    :raises jinja2.TemplateError: a bound passed (:func:`is_limit`), or the template's own
        refusal.
    """
    cap = MAX_TEMPLATE_STRING if cap is None else min(cap, MAX_TEMPLATE_STRING)
    _caps.cap = cap
    try:
        pieces: list[str] = []
        total = 0
        for piece in template.generate(**variables):
            total += len(piece)
            if total > cap:
                raise limit_error(
                    f"the chat template rendered more than {cap} characters (what the model's "
                    "window can hold at most)"
                )
            pieces.append(piece)
        return "".join(pieces)
    finally:
        del _caps.cap


# The helpers transformers gives chat templates.


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    import jinja2

    if isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT:
        # An indent is written before every line of the JSON: a huge one, in one C call.
        raise limit_error(f"the chat template asked tojson for an indent over {MAX_JSON_INDENT}")
    try:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )
    except (TypeError, ValueError) as e:
        # A function, a macro, a circular structure: no JSON, and the template's error.
        raise jinja2.exceptions.TemplateError(f"tojson: {e}") from None


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


__all__ = [
    "MAX_TEMPLATE_STRING",
    "bounded_join",
    "current_cap",
    "is_limit",
    "limit_error",
    "render_bounded",
    "template_environment",
]
