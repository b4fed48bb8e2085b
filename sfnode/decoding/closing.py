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
- With ``left`` tokens left (the EOS included) and a closing of length ``u``, the *slack* is
  ``left - u``.  Beyond :data:`CLOSING_GUARD` the mask is the grammar's, except where the
  output may end now and the grammar allows only a few other tokens: those after which the
  closing would no longer fit are removed (a second tool call that cannot be written).
  Within it the lane is **closing**: the tokens that spell the start of the closing text and
  leave room for the rest are allowed, and, while the slack is at least 1, the others after
  which the closing still fits (each one checked where the grammar allows at most
  :data:`VERIFIED_TOKENS`; inside a JSON string, a string's content, which leaves the closing
  as it was); at slack 0 only the first tokens of the closing's shortest spellings.  So the
  output ends with its grammar's end within its budget.

Everything here is a function of the grammar's state, the output's bytes and ``left``: the
walk from a state is deterministic, and from any state its walk passes through, the walk goes
on with the same bytes (the order of choices depends only on the state), so the closing after a
token that spells its start is the rest of its text, and every token a closing lane may draw
leaves it a closing that fits.  That is what keeps a closing lane's tokens the same alone or
batched, in either engine and after a failover (a new node, replaying the delivered tokens,
finds the same closings).

The guard keeps a token drawn freely from making the closing longer than the budget left:
one token opens at most a few tokens' worth of structure (measured on the targets' grammars:
at most 5, docs/engine.md section 2.4).  A single token that opens more outside the guard (an
optional property whose value needs many required ones) is not prevented.  Free text (where
the output may end and the grammar allows many tokens: ``tool_choice`` ``auto`` or ``none``)
is left to end where its budget does.

This module must never import torch, touch a model, start a thread or read the reactor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import llguidance
import numpy as np
from numpy.typing import NDArray

CLOSING_GUARD = 8
"""Tokens of budget beyond a closing's length at which a lane starts closing."""
MAX_CLOSING_BYTES = 1024
"""The longest closing text a walk looks for; a state with none so short is left alone."""
VERIFIED_TOKENS = 128
"""At most this many allowed tokens are checked one by one for room to close."""
_MEMO_LIMIT = 1 << 16
T = TypeVar("T")

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

    @property
    def in_string(self) -> bool:
        """Inside a string (a key's or a value's)."""
        return self.mode == _STRING or self.mode == _KEY_STRING

    def preferred(self) -> bytes:
        """The bytes a closing walk tries first here, best first (see the module)."""
        mode = self.mode
        end = b"}" if self.stack.endswith("{") else b"]"
        if mode == _STRING or mode == _KEY_STRING:
            return b'"'
        if mode == _NUMBER:
            return end + b",0123456789"
        if mode == _LITERAL:
            return end + b","
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

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int, eos: int) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        """An EOS id (a closing ends where the grammar allows it)."""
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
        self.content = _content_bits(self.bytes_of)
        """One bit per token (mask words) for the tokens that may stand inside a JSON string
        without ending it: whole UTF-8 characters, none of them a quote, a backslash or a
        control character."""
        self._fewest: dict[bytes, int] = {b"": 0}
        # Memos: replaced when full, never emptied (two threads may read one at once).
        self._spelled: dict[bytes, list[int]] = {}
        self._after: dict[tuple[JsonContext, bytes], JsonContext] = {}

    def spell(self, data: bytes) -> list[int]:
        """Tokens whose bytes are ``data``, as the tokenizer splits it (remembered: the same
        keys and separators are forced again and again)."""
        tokens = self._spelled.get(data)
        if tokens is None:
            if len(self._spelled) > _MEMO_LIMIT:
                self._spelled = {}
            tokens = self._spelled[data] = list(self.tokenizer.tokenize_bytes(data))
        return tokens

    def after(self, context: JsonContext, data: bytes) -> JsonContext:
        """``context.feed(data)``, remembered."""
        key = (context, data)
        found = self._after.get(key)
        if found is None:
            if len(self._after) > _MEMO_LIMIT:
                self._after = {}
            found = self._after[key] = context.feed(data)
        return found

    def fewest(self, text: bytes) -> int:
        """The fewest tokens whose bytes, in order, are ``text`` (a large number when none
        do).

        Remembered for every suffix of every text asked, the shortest first, in a table that
        is replaced when full, never emptied: a text found in a table has its suffixes there,
        also for the mask thread and the grammar thread, which ask at once."""
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
            self._fewest = memo = {b"": 0}
        for i in range(n - 1, -1, -1):
            memo[text[i:]] = best[i]
        return best[0]

    def starts(self, text: bytes) -> Iterable[tuple[int, int]]:
        """``(token, length)`` of every token whose bytes begin ``text``."""
        for length in range(1, min(len(text), max(self._longest.get(text[:2], 0), 1)) + 1):
            for token in self.tokens_of.get(text[:length], ()):
                yield token, length


def _content_bits(spellings: Sequence[bytes]) -> NDArray[np.int32]:
    bits = np.zeros((len(spellings) + 31) // 32 * 32, dtype=np.uint8)
    for token, data in enumerate(spellings):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data and not any(c in '"\\' or ord(c) < 0x20 for c in text):
            bits[token] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


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
    none within :data:`MAX_CLOSING_BYTES` bytes; the matcher is left as it was.

    Bytes after which the output may end are checked, not consumed (the grammar library takes
    longest to consume the token that ends an output)."""
    if matcher.is_accepting():
        return b""
    out = bytearray()
    consumed = 0
    try:
        while len(out) <= MAX_CLOSING_BYTES:
            forced = matcher.compute_ff_bytes()
            if forced:
                data, tokens = forced, table.spell(forced)
            else:
                choice = _choice(matcher, context, table)
                if choice is None:
                    return None
                data, tokens = _BYTES[choice[0]], [choice[1]]
            out += data
            if matcher.validate_tokens([*tokens, table.eos]) == len(tokens) + 1:
                return bytes(out)
            taken = matcher.try_consume_tokens(tokens)
            consumed += taken
            if taken < len(tokens):
                return None
            context = table.after(context, data)
        return None
    finally:
        if consumed:
            matcher.rollback(consumed)


def _choice(
    matcher: llguidance.LLMatcher, context: JsonContext, table: TokenTable
) -> tuple[int, int] | None:
    """The walk's byte where the grammar leaves a choice, and its token (None: the grammar
    allows no single byte here)."""
    single = table.single
    for byte in context.preferred():
        token = single[byte]
        if token >= 0 and matcher.validate_tokens([token]) == 1:
            return byte, token
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    for byte in _FALLBACK:
        token = single[byte]
        if token >= 0 and bits[token >> 3] >> (token & 7) & 1:
            return byte, token
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
    after each token, the closings found so far, and which of its tokens were drawn from a
    mask the budget narrowed; told of every token its matcher consumes or takes back.

    What it remembers of a state is keyed by the state's tokens (a hash of them), so that a
    draft's states, filled and taken back before the lane draws them (docs/engine.md section
    3.1), are found again when the lane does draw them.
    """

    def __init__(self, table: TokenTable, eos_ids: frozenset[int]) -> None:
        self.table = table
        self.eos_ids = eos_ids
        self.limit: int | None = None
        """The most tokens the output may have (None: no budget)."""
        self._tokens: list[int] = []
        self._contexts = [JSON_START]
        self._keys = [0]
        """Per number of tokens, a hash of the tokens."""
        self._closings: dict[int, tuple[int, Closing | None]] = {}
        """By state: its number of tokens and its closing, where it was found."""
        self._narrowed: dict[int, tuple[int, bool]] = {}
        """By state: its number of tokens and whether its mask was narrowed."""
        self._drawn_narrowed: list[bool] = []
        """Per token: whether it was drawn from a narrowed mask."""

    @property
    def count(self) -> int:
        """Tokens consumed."""
        return len(self._tokens)

    def advanced(self, token: int) -> None:
        """The matcher consumed ``token``."""
        key = self._keys[-1]
        self._drawn_narrowed.append(self._narrowed.get(key, (0, False))[1])
        self._tokens.append(token)
        self._contexts.append(self.table.after(self._contexts[-1], self.table.bytes_of[token]))
        self._keys.append(hash((key, token)))

    def rolled_back(self, tokens: int) -> None:
        """The matcher took back its last ``tokens`` tokens."""
        if tokens:
            kept = len(self._tokens) - tokens
            del self._tokens[kept:]
            del self._contexts[kept + 1 :]
            del self._keys[kept + 1 :]
            del self._drawn_narrowed[kept:]

    @property
    def due(self) -> bool:
        """Whether the budget may narrow the mask here (it is near enough)."""
        if self.limit is None:
            return False
        left = self.limit - len(self._tokens)
        return 0 < left <= MAX_CLOSING_BYTES + CLOSING_GUARD + 2

    @property
    def closed(self) -> bool:
        """Whether the output ended with an EOS, and a token of it was drawn from a mask the
        budget narrowed (without its budget, the output could have gone otherwise)."""
        ended = bool(self._tokens) and self._tokens[-1] in self.eos_ids
        return ended and any(self._drawn_narrowed)

    def closing(self, matcher: llguidance.LLMatcher) -> Closing | None:
        """The closing of the matcher's state: the rest of the previous state's when the last
        token spells its start (the walk goes on the same way), else walked."""
        count, key = len(self._tokens), self._keys[-1]
        if key in self._closings:
            return self._closings[key][1]
        before = self._closings.get(self._keys[-2]) if count else None
        found: Closing | None
        if before is not None and before[1] is not None:
            rest = _rest(before[1].text, self.table.bytes_of[self._tokens[-1]])
            if rest is not None:
                found = Closing(rest, self.table.fewest(rest) + 1)
                _remember(self._closings, key, count, found)
                return found
        found = closing_of(matcher, self._contexts[-1], self.table)
        _remember(self._closings, key, count, found)
        return found

    def narrow(self, matcher: llguidance.LLMatcher, masks: NDArray[np.int32], row: int) -> None:
        """Narrow ``masks[row]``, the grammar's mask at the matcher's state (see the module),
        and remember whether that removed a token."""
        narrowed = False
        if self.due and not matcher.is_stopped():
            closing = self.closing(matcher)
            if closing is not None:
                assert self.limit is not None
                left = self.limit - len(self._tokens)
                narrowed = self._narrow(_Row(matcher, masks, row, closing, left))
        _remember(self._narrowed, self._keys[-1], len(self._tokens), narrowed)

    def _narrow(self, row: _Row) -> bool:
        before = row.mask.copy()
        closing, left = row.closing, row.left
        slack = left - closing.length
        if not closing.text:
            # The output may end here: check the few other tokens (free text is left alone).
            self._verify(row, set(self.eos_ids), free=True)
        elif slack <= 0:
            row.keep_only(self._closing_tokens(closing, max(left, closing.length) - 1))
        elif slack <= CLOSING_GUARD:
            # Closing with room to spare: what else still leaves room to close is allowed too.
            self._verify(row, self._closing_tokens(closing, left - 1))
        if not row.mask.any():
            row.mask[:] = before  # nothing found to keep: the grammar's mask stands
        return not np.array_equal(before, row.mask)

    def _closing_tokens(self, closing: Closing, room: int) -> set[int]:
        """The tokens that begin the closing text and leave its rest spelled in ``room``
        tokens at most, its EOS included (the EOS where the text is empty)."""
        keep = set(self.eos_ids) if not closing.text else set()
        for token, length in self.table.starts(closing.text):
            if self.table.fewest(closing.text[length:]) + 1 <= room:
                keep.add(token)
        return keep

    def _verify(self, row: _Row, keep: set[int], *, free: bool = False) -> None:
        """Keep of the row the tokens in ``keep`` and the others after which a closing fits in
        ``left - 1`` tokens: each checked where there are at most :data:`VERIFIED_TOKENS` of
        them.  Where there are more: inside a JSON string, every token of a string's content
        (it leaves the closing as it was) is kept; ``free`` (the output may end here: free
        text) leaves the row alone; else only ``keep`` stays."""
        allowed = np.flatnonzero(np.unpackbits(row.mask.view(np.uint8), bitorder="little"))
        others = (
            [int(t) for t in allowed if int(t) not in keep]
            if len(allowed) <= VERIFIED_TOKENS + len(keep)
            else None
        )
        if others is None or len(others) > VERIFIED_TOKENS:
            if free:
                return
            content = row.mask & self.table.content if self._contexts[-1].in_string else 0
            row.keep_only(keep)
            mask = row.mask
            mask |= content
            return
        context = self._contexts[-1]
        for token in others:
            length = self._length_after(row.matcher, row.closing, context, token)
            if length is None or length > row.left - 1:
                row.mask[token >> 5] &= ~_bit(token)

    def _length_after(
        self, matcher: llguidance.LLMatcher, closing: Closing, context: JsonContext, token: int
    ) -> int | None:
        """The closing length after ``token`` (None: no closing)."""
        spelled = self.table.bytes_of[token]
        rest = _rest(closing.text, spelled)
        if rest is not None:
            return self.table.fewest(rest) + 1
        if not spelled:
            return None
        if matcher.validate_tokens([token, self.table.eos]) == 2:
            return 1
        if not matcher.try_consume_tokens([token]):
            return None
        try:
            after = closing_of(matcher, self.table.after(context, spelled), self.table)
        finally:
            matcher.rollback(1)
        return None if after is None else after.length


def _rest(text: bytes, spelled: bytes) -> bytes | None:
    """What is left of a closing text after a token that spells its start (None: it does
    not)."""
    if spelled and text.startswith(spelled):
        return text[len(spelled) :]
    return None


def _remember(memo: dict[int, tuple[int, T]], key: int, count: int, value: T) -> None:
    """``memo[key] = (count, value)``, forgetting states two tokens or more before."""
    if len(memo) > 16:
        for old in [k for k, (c, _) in memo.items() if c < count - 1 or c > count + 8]:
            del memo[old]
    memo[key] = (count, value)


def _bit(token: int) -> np.int32:
    return np.int32(np.uint32(1 << (token & 31)).view(np.int32))


@dataclass
class _Row:
    """One mask row being narrowed: the lane's matcher, the row (a view of the masks), the
    lane's closing and the tokens it has left."""

    matcher: llguidance.LLMatcher
    masks: NDArray[np.int32]
    index: int
    closing: Closing
    left: int

    @property
    def mask(self) -> NDArray[np.int32]:
        """The row, a view: writing it writes the masks."""
        mask: NDArray[np.int32] = self.masks[self.index]
        return mask

    def keep_only(self, tokens: Iterable[int]) -> None:
        """Keep of the row only the bits of ``tokens`` (those already set)."""
        mask = self.mask
        kept = np.zeros_like(mask)
        for token in tokens:
            word = token >> 5
            if word < kept.shape[0]:
                kept[word] |= mask[word] & _bit(token)
        mask[:] = kept
