"""The shortest closing of a constrained output, and what a token budget does to a lane's mask
(docs/engine.md section 2.4, docs/protocol.md section 12.6).

A constrained lane that is cut by its budget (``max_new``) in the middle of its structure ends
with output that does not parse.  So every mask of a constrained lane with a budget is narrowed
as its budget runs out:

- The **closing** of a state is the text the output needs to end there, found by a *closing
  walk* (:func:`closing_text`): byte by byte from the grammar's state, the bytes the grammar
  forces are taken as they are, and where it leaves a choice the first byte it allows in the
  order of :meth:`JsonContext.preferred` (the byte that closes soonest where the output stands
  in its JSON: a string's quote, the enclosing object's or array's end, a comma, the shortest
  value), until the output may end.  Its **length** is the fewest tokens that spell that text,
  plus the EOS (:meth:`TokenTable.fewest`).
- With ``r`` tokens left (the EOS included) and a closing of length ``u``: while
  ``r - u > CLOSING_GUARD`` the mask is the grammar's, except where the output may end now
  and the grammar allows only a few other tokens: then those after which the closing would
  no longer fit are removed (a second tool call that cannot be written).  From
  ``r - u <= CLOSING_GUARD`` on, the lane is **closing**: only the tokens that spell the
  start of the closing text and leave room for the rest of it are allowed (only the first
  tokens of its shortest spellings once ``r == u``; the EOS when the text is empty), so the
  output ends with its grammar's end within its budget.

Everything here is a function of the grammar's state, the output's bytes and ``r``: the walk
from a state is deterministic, and from any state its walk passes through, the walk goes on
with the same bytes (the order of choices depends only on the state), so the closing after a
token that spells its start is the rest of its text, and a lane that is closing stays so.
That is what keeps a closing lane's tokens the same alone or batched, in either engine and
after a failover (a new node, replaying the delivered tokens, finds the same closing).

The guard keeps a token drawn freely from making the closing longer than the budget left:
one token opens at most a few tokens' worth of structure (measured on the targets' grammars:
at most 5, docs/engine.md section 2.4).  A single token that opens more outside the guard (an
optional property whose value needs many required ones) is not prevented.

This module must never import torch, touch a model, start a thread or read the reactor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
from numpy.typing import NDArray

CLOSING_GUARD = 8
"""Tokens of budget beyond a closing's length at which a lane starts closing."""
MAX_CLOSING_BYTES = 1024
"""The longest closing text a walk looks for; a state with none so short is left alone."""
VERIFIED_ENDINGS = 64
"""Where the output may end, at most this many other allowed tokens are checked one by one."""
_MEMO_LIMIT = 1 << 16

# Where the output stands in its JSON (a closing walk's order of choices depends on it).
_OUTSIDE, _VALUE, _FIRST_ITEM, _FIRST_KEY, _KEY, _STRING, _KEY_STRING = range(7)
_AFTER_KEY, _AFTER_VALUE, _NUMBER, _LITERAL = range(7, 11)

_VALUES = b'0"[{ntf-123456789'
"""A value's first byte, the shortest values first (``0``, then ``""``, ``[]``, ``{}``...)."""


def _fallback_rank(byte: int) -> tuple[int, int]:
    group = 3
    if 0x61 <= byte <= 0x7A:
        group = 0
    elif 0x30 <= byte <= 0x39:
        group = 1
    elif 0x41 <= byte <= 0x5A:
        group = 2
    return group, byte if 0x20 <= byte <= 0x7E else 0x100 + byte


_FALLBACK_ORDER: list[int] = sorted(range(256), key=_fallback_rank)
_FALLBACK = bytes(_FALLBACK_ORDER)
"""Where no preferred byte is allowed: lower-case letters, digits, upper-case letters, other
printable ASCII, then every other byte, each group in ascending order."""


@dataclass(frozen=True, slots=True)
class JsonContext:
    """Where output bytes leave a JSON text: inside a string (a key's or a value's), a number or
    a literal, or between tokens of it, and the open objects and arrays (``stack``, ``{`` and
    ``[`` innermost last).  Text outside JSON (a tool call's tags) is :data:`_OUTSIDE`."""

    mode: int = _OUTSIDE
    stack: str = ""
    escaped: bool = False

    def feed(self, data: bytes) -> JsonContext:
        """Where the output stands after ``data`` more bytes."""
        mode, stack, escaped = self.mode, self.stack, self.escaped
        for byte in data:
            if mode == _STRING or mode == _KEY_STRING:
                if escaped:
                    escaped = False
                elif byte == 0x5C:
                    escaped = True
                elif byte == 0x22:
                    mode = _AFTER_KEY if mode == _KEY_STRING else _AFTER_VALUE
                continue
            if byte == 0x20:
                if mode == _NUMBER or mode == _LITERAL:
                    mode = _AFTER_VALUE
                continue
            if mode == _NUMBER or mode == _LITERAL:
                if 0x30 <= byte <= 0x39 or 0x61 <= (byte | 0x20) <= 0x7A or byte in b".+-":
                    continue
                mode = _AFTER_VALUE
            mode, stack = _step(mode, stack, byte)
        return JsonContext(mode, stack, escaped)

    def preferred(self) -> bytes:
        """The bytes a closing walk tries first here, best first (see the module)."""
        mode = self.mode
        end = b"}" if self.stack.endswith("{") else b"]"
        if mode == _STRING or mode == _KEY_STRING:
            return b'"'
        if mode == _NUMBER:
            return end + b",0123456789"
        if mode == _VALUE:
            return _VALUES
        if mode == _FIRST_ITEM:
            return b"]" + _VALUES
        if mode == _FIRST_KEY:
            return b'}"'
        if mode == _KEY:
            return b'"'
        if mode == _AFTER_KEY:
            return b":"
        if mode == _AFTER_VALUE:
            return end + b","
        return b""


def _step(mode: int, stack: str, byte: int) -> tuple[int, str]:
    """The context after one byte that is not inside a string, a number or a literal."""
    if byte == 0x7B:
        return _FIRST_KEY, stack + "{"
    if byte == 0x5B:
        return _FIRST_ITEM, stack + "["
    if byte == 0x7D or byte == 0x5D:
        stack = stack[:-1]
        return (_AFTER_VALUE if stack else _OUTSIDE), stack
    if byte == 0x22:
        return (_KEY_STRING if mode in (_FIRST_KEY, _KEY) else _STRING), stack
    if byte == 0x2C:
        return (_KEY if stack.endswith("{") else _VALUE), stack
    if byte == 0x3A:
        return _VALUE, stack
    if mode in (_VALUE, _FIRST_ITEM):
        return (_NUMBER if 0x30 <= byte <= 0x39 or byte == 0x2D else _LITERAL), stack
    return mode, stack


_BYTES = [bytes((b,)) for b in range(256)]

JSON_START = JsonContext()
"""Where an output stands before its first byte."""


class TokenTable:
    """A vocabulary's tokens as bytes, for closing walks: each token's bytes, the tokens of each
    byte string, the token of each single byte, and the fewest tokens that spell a text
    (remembered, since consecutive closings share their ends).  Special tokens spell nothing."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int) -> None:
        self.tokenizer = tokenizer
        self.bytes_of: list[bytes] = [b""] * size
        ids: dict[bytes, list[int]] = {}
        for token in range(min(size, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token):
                continue
            data = tokenizer.decode_bytes([token])
            if data:
                self.bytes_of[token] = data
                ids.setdefault(data, []).append(token)
        self.tokens_of = {data: tuple(tokens) for data, tokens in ids.items()}
        """The tokens (ascending) whose bytes are exactly a byte string."""
        self.single = [self.tokens_of.get(bytes([b]), (-1,))[0] for b in range(256)]
        """The token of each byte alone (-1: none)."""
        longest: dict[bytes, int] = {}
        for data in self.tokens_of:
            key = data[:2]
            longest[key] = max(longest.get(key, 0), len(data))
        self._longest = longest
        """The longest token starting with each token's first two bytes (one for one-byte
        tokens)."""
        self._fewest: dict[bytes, int] = {b"": 0}
        self._spelled: dict[bytes, list[int]] = {}
        self._after: dict[tuple[JsonContext, bytes], JsonContext] = {}

    def spell(self, data: bytes) -> list[int]:
        """Tokens whose bytes are ``data``, as the tokenizer splits it (remembered: the same
        keys and separators are forced again and again)."""
        tokens = self._spelled.get(data)
        if tokens is None:
            if len(self._spelled) > _MEMO_LIMIT:
                self._spelled.clear()
            tokens = self._spelled[data] = list(self.tokenizer.tokenize_bytes(data))
        return tokens

    def after(self, context: JsonContext, data: bytes) -> JsonContext:
        """``context.feed(data)``, remembered."""
        key = (context, data)
        found = self._after.get(key)
        if found is None:
            if len(self._after) > _MEMO_LIMIT:
                self._after.clear()
            found = self._after[key] = context.feed(data)
        return found

    def fewest(self, text: bytes) -> int:
        """The fewest tokens whose bytes, in order, are ``text`` (a large number when none
        do)."""
        memo = self._fewest
        known = memo.get(text)
        if known is not None:
            return known
        n = len(text)
        start = next(i for i in range(n + 1) if text[i:] in memo)
        best = [0] * (n + 1)
        for i in range(start, n + 1):
            best[i] = memo[text[i:]]
        unreachable = 1 << 30
        for i in range(start - 1, -1, -1):
            fewest = unreachable
            limit = min(n - i, max(self._longest.get(text[i : i + 2], 0), 1))
            for length in range(1, limit + 1):
                if text[i : i + length] in self.tokens_of and best[i + length] + 1 < fewest:
                    fewest = best[i + length] + 1
            best[i] = fewest
        if len(memo) > _MEMO_LIMIT:
            memo.clear()
            memo[b""] = 0
        for i in range(start):
            memo[text[i:]] = best[i]
        return best[0]

    def starts(self, text: bytes) -> Iterable[tuple[int, int]]:
        """``(token, length)`` of every token whose bytes begin ``text``."""
        for length in range(1, min(len(text), max(self._longest.get(text[:2], 0), 1)) + 1):
            for token in self.tokens_of.get(text[:length], ()):
                yield token, length


@dataclass(frozen=True)
class Closing:
    """A state's closing: its text (empty where the output may end) and its length, the fewest
    tokens that spell the text plus the EOS."""

    text: bytes
    length: int


def closing_text(
    matcher: llguidance.LLMatcher, context: JsonContext, table: TokenTable
) -> bytes | None:
    """The closing walk's text from ``matcher``'s state (see the module), or None when it finds
    none within :data:`MAX_CLOSING_BYTES` bytes; the matcher is left as it was."""
    out = bytearray()
    consumed = 0
    try:
        while len(out) <= MAX_CLOSING_BYTES:
            if matcher.is_accepting():
                return bytes(out)
            forced = matcher.compute_ff_bytes()
            if forced:
                tokens = table.spell(forced)
                taken = matcher.try_consume_tokens(tokens)
                consumed += taken
                if taken < len(tokens):
                    return None
                out += forced
                context = table.after(context, forced)
                continue
            byte = _choice(matcher, context, table)
            if byte is None:
                return None
            consumed += 1
            out.append(byte)
            context = table.after(context, _BYTES[byte])
        return None
    finally:
        if consumed:
            matcher.rollback(consumed)


def _choice(matcher: llguidance.LLMatcher, context: JsonContext, table: TokenTable) -> int | None:
    """Consume the walk's byte where the grammar leaves a choice, and return it (None: the
    grammar allows no single byte here)."""
    single = table.single
    for byte in context.preferred():
        token = single[byte]
        if token >= 0 and matcher.try_consume_tokens([token]) == 1:
            return byte
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    for byte in _FALLBACK:
        token = single[byte]
        if token >= 0 and bits[token >> 3] >> (token & 7) & 1:
            if matcher.try_consume_tokens([token]) == 1:
                return byte
    return None


def closing_of(
    matcher: llguidance.LLMatcher, context: JsonContext, table: TokenTable
) -> Closing | None:
    """The closing of ``matcher``'s state (None: none found)."""
    text = closing_text(matcher, context, table)
    if text is None:
        return None
    return Closing(text, table.fewest(text) + 1)


class LaneBudget:
    """One lane's budget (see the module): the tokens it may have, where its output stands
    after each token, and the closings found so far; told of every token its matcher consumes
    or takes back."""

    def __init__(self, table: TokenTable, eos_ids: frozenset[int]) -> None:
        self.table = table
        self.eos_ids = eos_ids
        self.limit: int | None = None
        """The most tokens the output may have (None: no budget)."""
        self._tokens: list[int] = []
        self._contexts = [JSON_START]
        self._closings: dict[int, Closing | None] = {}
        """The closing of the state after each number of tokens, where it was found."""

    def advanced(self, token: int) -> None:
        """The matcher consumed ``token``."""
        self._tokens.append(token)
        self._contexts.append(self.table.after(self._contexts[-1], self.table.bytes_of[token]))

    def rolled_back(self, tokens: int) -> None:
        """The matcher took back its last ``tokens`` tokens."""
        if tokens:
            del self._tokens[len(self._tokens) - tokens :]
            del self._contexts[len(self._contexts) - tokens :]
            for count in [c for c in self._closings if c > len(self._tokens)]:
                del self._closings[count]

    @property
    def closed(self) -> bool:
        """Whether the output ended with an EOS drawn while the lane was closing: the state
        before it could end at once (a closing of one token), within the guard."""
        if self.limit is None or not self._tokens or self._tokens[-1] not in self.eos_ids:
            return False
        return self.limit - len(self._tokens) <= CLOSING_GUARD

    def closing(self, matcher: llguidance.LLMatcher) -> Closing | None:
        """The closing of the matcher's state: the rest of the previous state's when the last
        token spells its start (the walk goes on the same way), else walked."""
        count = len(self._tokens)
        if count in self._closings:
            return self._closings[count]
        before = self._closings.get(count - 1) if count else None
        if before is not None:
            spelled = self.table.bytes_of[self._tokens[-1]]
            if spelled and before.text.startswith(spelled):
                rest = before.text[len(spelled) :]
                return self._remember(count, Closing(rest, self.table.fewest(rest) + 1))
        return self._remember(count, closing_of(matcher, self._contexts[-1], self.table))

    def _remember(self, count: int, closing: Closing | None) -> Closing | None:
        """Keep the closing after ``count`` tokens, and forget those before ``count - 1``."""
        for older in [c for c in self._closings if c < count - 1]:
            del self._closings[older]
        self._closings[count] = closing
        return closing

    def narrow(self, matcher: llguidance.LLMatcher, masks: NDArray[np.int32], row: int) -> None:
        """Narrow ``masks[row]``, the grammar's mask at the matcher's state (see the module)."""
        if self.limit is None:
            return
        left = self.limit - len(self._tokens)
        if left <= 0 or left > MAX_CLOSING_BYTES + CLOSING_GUARD + 2 or matcher.is_stopped():
            return
        closing = self.closing(matcher)
        if closing is None:
            return
        if left - closing.length > CLOSING_GUARD:
            if not closing.text:
                self._verify_endings(matcher, left, masks, row)
            return
        room = max(left, closing.length) - 1
        keep = [t for t in self.eos_ids if not closing.text]
        keep += [
            token
            for token, length in self.table.starts(closing.text)
            if self.table.fewest(closing.text[length:]) + 1 <= room
        ]
        _keep_only(masks, row, keep)

    def _verify_endings(
        self, matcher: llguidance.LLMatcher, left: int, masks: NDArray[np.int32], row: int
    ) -> None:
        """Where the output may end: remove the few other tokens after which no closing fits
        in what is left."""
        bits = np.unpackbits(masks[row].view(np.uint8), bitorder="little")
        others = [int(t) for t in np.flatnonzero(bits) if int(t) not in self.eos_ids]
        if len(others) > VERIFIED_ENDINGS:
            return
        context = self._contexts[-1]
        for token in others:
            if not matcher.try_consume_tokens([token]):
                continue
            try:
                after = closing_of(
                    matcher, self.table.after(context, self.table.bytes_of[token]), self.table
                )
            finally:
                matcher.rollback(1)
            if after is None or after.length > left - 1:
                masks[row, token >> 5] &= ~_bit(token)


def _bit(token: int) -> np.int32:
    return np.int32(np.uint32(1 << (token & 31)).view(np.int32))


def _keep_only(masks: NDArray[np.int32], row: int, tokens: Sequence[int]) -> None:
    """Keep of ``masks[row]`` only the bits of ``tokens`` (those already set)."""
    kept = np.zeros_like(masks[row])
    for token in tokens:
        word = token >> 5
        if word < kept.shape[0]:
            kept[word] |= masks[row, word] & _bit(token)
    if kept.any():
        masks[row] = kept
