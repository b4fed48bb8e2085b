"""OpenAI's ``logprobs`` objects, built from the token logprobs nodes return (docs/protocol.md
section 12.1).

One :class:`ChoiceLogprobs` per choice of a request that asked for logprobs.  The HTTP layer
adds each token it shows (with the logprob the node sent and where its text starts), takes
the entries added since the last chunk for each streamed chunk, and the whole list for a
non-streamed answer.  Two shapes, as OpenAI answers them:

- chat (``logprobs`` / ``top_logprobs``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}``;
- completions (``logprobs: N``): ``{"tokens": [...], "token_logprobs": [...],
  "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}``, where each
  ``top_logprobs`` mapping holds the N most likely tokens and the chosen one (up to N + 1
  entries, as OpenAI says) and ``text_offset`` is where the token's text starts in the
  completion's text.

A token is named by its text, or ``bytes:\\xNN...`` when its bytes are not whole characters
(:func:`~sfnode.head.models.text.token_text`); ``bytes`` are those bytes.

This module is pure: it must never touch the reactor, the network or a node, and never list
more alternatives than the request asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sfnode.generation import TokenLogprob
from sfnode.head.models.text import token_text


@dataclass(frozen=True, slots=True)
class _Entry:
    token: int
    logprob: TokenLogprob
    offset: int


@dataclass(eq=False)
class ChoiceLogprobs:
    """The logprobs of one choice: entries added as tokens are shown, rendered in chunks."""

    chat: bool
    top: int
    """How many most likely tokens to list beside each chosen one (top_logprobs, or N)."""
    token_bytes: Callable[[int], bytes]
    """The bytes a token id stands for (``Renderer.token_bytes``)."""
    _entries: list[_Entry] = field(default_factory=list)
    _taken: int = 0

    def add(self, token: int, logprob: TokenLogprob, offset: int) -> None:
        """One more token shown: ``offset`` is where its text starts in the choice's text."""
        self._entries.append(_Entry(token, logprob, offset))

    @property
    def pending(self) -> bool:
        """Whether entries were added since the last :meth:`take`."""
        return self._taken < len(self._entries)

    def take(self) -> dict[str, Any]:
        """The object of the entries added since the last call (a streamed chunk's)."""
        entries, self._taken = self._entries[self._taken :], len(self._entries)
        return self._render(entries)

    def whole(self) -> dict[str, Any]:
        """The object of every entry (a non-streamed answer's)."""
        return self._render(self._entries)

    def _render(self, entries: list[_Entry]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tops = []
        for e in entries:
            top = {self._name(t): v for t, v in e.logprob.top[: self.top]}
            top.setdefault(self._name(e.token), e.logprob.logprob)
            tops.append(top)
        return {
            "tokens": [self._name(e.token) for e in entries],
            "token_logprobs": [e.logprob.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.offset for e in entries],
        }

    def _name(self, token: int) -> str:
        return token_text(self.token_bytes(token))

    def _chat_entry(self, entry: _Entry) -> dict[str, Any]:
        return {
            **self._piece(entry.token, entry.logprob.logprob),
            "top_logprobs": [self._piece(t, v) for t, v in entry.logprob.top[: self.top]],
        }

    def _piece(self, token: int, logprob: float) -> dict[str, Any]:
        data = self.token_bytes(token)
        return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}


__all__ = ["ChoiceLogprobs"]
