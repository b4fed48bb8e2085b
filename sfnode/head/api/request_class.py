"""Request classes at the head: which of an HTTP request's generations someone waits on.

A completion is ``interactive`` (a person waits for it: a chat), ``batch`` (throughput work:
agents, evaluations, bulk jobs) or ``background`` (batch work that waits for all other: the
head ranks it last in its queue and takes its lanes back first, docs/protocol.md section 8.5;
nodes see it as batch); the class travels to the node in GENERATE_REQ, whose scheduler admits
interactive work first (docs/protocol.md section 12.2).  A client may say which with the
header ``X-Request-Class: interactive|batch|background`` (or its API key's ``class=``); OpenAI
clients send nothing special, so the head's default (``--default-request-class``) decides the
rest: ``auto`` (the default) takes a prompt of at most ``--interactive-prompt-tokens`` tokens
for a chat and a longer one for batch work, ``interactive`` or ``batch`` give every such
request that class.

This module must never do I/O or hold state: it is a header parser and a pure rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sfnode.linkf.wire import RequestClass
from sfnode.runtime.http_guard import HttpError, clip

HEADER = b"x-request-class"
"""The request header that names a request's class (compared case-insensitively)."""
DEFAULT_INTERACTIVE_PROMPT_TOKENS = 1024
"""Under ``auto``: the longest prompt (in tokens) taken for interactive.  A chat turn with some
history fits; an agent's prompt of a thousand words or more (tools, files, instructions) does
not."""



class HeadClass(enum.IntEnum):
    """A request's class at the head: its rank in the queue and in preemption (lower first).
    The first two are the wire's own numbers (:class:`RequestClass`); background is the
    head's own and goes to nodes as batch."""

    INTERACTIVE = 0
    BATCH = 1
    BACKGROUND = 2

    @property
    def wire(self) -> RequestClass:
        """The class GENERATE_REQ carries."""
        return RequestClass.INTERACTIVE if self is HeadClass.INTERACTIVE else RequestClass.BATCH


_NAMES = {klass.name.lower(): klass for klass in HeadClass}


class DefaultClass(enum.Enum):
    """The class of a request that does not say (``--default-request-class``)."""

    AUTO = "auto"
    """By prompt length: interactive up to the threshold, batch above."""
    INTERACTIVE = "interactive"
    BATCH = "batch"


DEFAULT_CLASSES = tuple(d.value for d in DefaultClass)


def class_name(request_class: int) -> str:
    """``interactive``, ``batch`` or ``background``: the header's own words."""
    return HeadClass(min(int(request_class), HeadClass.BACKGROUND)).name.lower()


def parse_header(value: bytes | None) -> HeadClass | None:
    """The class an ``X-Request-Class`` header names, or None when it is absent.

    :raises HttpError: 400 ``invalid_request_class`` for any other value.
    """
    if value is None:
        return None
    name = value.decode("latin-1").strip().lower()
    found = _NAMES.get(name)
    if found is None:
        raise HttpError(
            400,
            f"the X-Request-Class header must be 'interactive', 'batch' or 'background', not "
            f"{clip(value.decode('latin-1'))!r}",
            code="invalid_request_class",
        )
    return found


@dataclass(frozen=True, slots=True)
class ClassRule:
    """How the head classes a request (the head's options)."""

    default: DefaultClass = DefaultClass.AUTO
    interactive_prompt_tokens: int = DEFAULT_INTERACTIVE_PROMPT_TOKENS

    def classify(self, named: HeadClass | None, prompt_tokens: int) -> HeadClass:
        """The class of a request whose header named ``named`` (None: no header) and whose
        prompt has ``prompt_tokens`` tokens: the header when given, else the default."""
        if named is not None:
            return named
        if self.default is DefaultClass.INTERACTIVE:
            return HeadClass.INTERACTIVE
        if self.default is DefaultClass.BATCH:
            return HeadClass.BATCH
        if prompt_tokens <= self.interactive_prompt_tokens:
            return HeadClass.INTERACTIVE
        return HeadClass.BATCH


__all__ = [
    "DEFAULT_CLASSES",
    "DEFAULT_INTERACTIVE_PROMPT_TOKENS",
    "HEADER",
    "ClassRule",
    "DefaultClass",
    "HeadClass",
    "class_name",
    "parse_header",
]
